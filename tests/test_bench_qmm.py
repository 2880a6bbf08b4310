"""scripts/bench_qmm.py's profile summary: ncu's kernel durations mapped back to layers and arms."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

from mtpcli.kernels import quantized_matmul as qm

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_qmm.py"
_spec = importlib.util.spec_from_file_location("bench_qmm", _PATH)
bench_qmm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_qmm)

HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)
LAYERS = {"small 128->64": (128, 64), "big 256->4096": (256, 4096)}


def _csv(durations_ns: list[int], extra: tuple[tuple[str, str, str], ...] = ()) -> str:
    """What ncu prints with --csv: its own log lines, the header, a row a kernel and metric
    (``extra``: more metrics a kernel, (name, unit, value), as --metrics a,b,c gives them)."""
    head = '"7","python3.12","h","mtp_qmm_x","1","14","(256, 1, 1)","(4, 1, 1)","0","9.0"'
    rows = []
    for i, ns in enumerate(durations_ns):
        for name, unit, value in (("gpu__time_duration.sum", "ns", f"{ns:,}"), *extra):
            rows.append(f'"{i}",{head},"Command line profiler metrics","{name}","{unit}","{value}"')
    return "\n".join(["==PROF== Connected to process 7", HEADER, *rows]) + "\n"


def test_layer_bytes_are_what_the_benchmark_allocates():
    for k, n, gs, bits in ((128, 64, 64, 4), (256, 48, 32, 8), (512, 16, 128, 4)):
        w, scales, biases = qm.random_quantized(n, k, gs, bits, mx.bfloat16, seed=0)
        assert bench_qmm.layer_bytes(k, n, bits, gs) == w.nbytes + scales.nbytes + biases.nbytes


def test_durations_map_to_the_plan_in_order_as_medians_of_their_repeats():
    # the plan: 1 GiB read, then per layer its read and arms 8, 8x5 at M = 1, 3 ("mlx" skipped)
    plan = ["gib"]
    for name in LAYERS:
        plan += [(name, "read")] + [(name, a, m) for a in ("8", "8x5") for m in (1, 3)]
    base = {what: 1000 * (i + 1) for i, what in enumerate(plan)}  # ns, distinct per launch
    ns = [base[what] + d for what in plan for d in (0, 500, -200)]  # medians: base itself
    s = bench_qmm.ncu_summary(_csv(ns), ["8", "mlx", "8x5"], LAYERS, repeats=3)
    assert s["stream_1gib_us"] == 1.0
    assert s["device_read_gb_s"] == pytest.approx(2**30 / 1000)
    for name, (k, n) in LAYERS.items():
        row = s["layers"][name]
        assert row["read_us"] == base[(name, "read")] / 1000
        assert row["bytes"] == bench_qmm.layer_bytes(k, n)
        assert row["read_gb_s"] == pytest.approx(row["bytes"] / base[(name, "read")])
        for arm in ("8", "8x5"):
            assert row[arm] == {m: base[(name, arm, m)] / 1000 for m in (1, 3)}
    table = bench_qmm.ncu_markdown(s, ["8", "mlx", "8x5"])
    assert table.count("| small 128->64 |") == 2 and "| mlx |" not in table
    # The same profile with occupancy and DRAM rows beside each duration (the H200's runs:
    # their "%" unit once stopped the summary) maps to the same figures.
    more = (("sm__warps_active.avg.pct_of_peak_sustained_active", "%", "30.25"),
            ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", "43.10"))  # fmt: skip
    assert bench_qmm.ncu_summary(_csv(ns, more), ["8", "mlx", "8x5"], LAYERS, repeats=3) == s


def test_a_profile_that_does_not_fit_the_plan_is_refused():
    n = (1 + 2 * (1 + 2 * 2)) * 3  # the plan's launches, 3 repeats each
    assert bench_qmm.ncu_summary(_csv([1000] * n), ["8", "8x5"], LAYERS, 3)  # fits
    with pytest.raises(ValueError, match="kernels profiled"):
        bench_qmm.ncu_summary(_csv([1000] * (n - 1)), ["8", "8x5"], LAYERS, 3)
    with pytest.raises(ValueError, match="CSV header"):
        bench_qmm.ncu_summary("==WARNING== No kernels were profiled.\n", ["8"], LAYERS, 1)


def test_the_summary_runs_without_a_gpu_and_writes_its_table(tmp_path):
    """``--ncu-summary`` reads a profile taken on the GPU machine, here (no CUDA needed)."""
    import json
    import subprocess
    import sys

    n = (1 + len(bench_qmm.STEP_LAYERS) * 3) * 2  # 1 GiB read; per product its read, M = 1, 3
    profile = tmp_path / "step.csv"
    profile.write_text(_csv([2000] * n))
    out = subprocess.run(
        [sys.executable, str(_PATH), "--step", "--ncu-summary", str(profile), "--arms", "8",
         "--launch-repeats", "2", "--out", str(tmp_path), "--name", "s"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("| 8 |") == len(bench_qmm.STEP_LAYERS)
    saved = json.loads((tmp_path / "s.json").read_text())
    assert set(saved["layers"]) == set(bench_qmm.STEP_LAYERS) and saved["launch_repeats"] == 2
