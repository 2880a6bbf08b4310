"""scripts/probe_timeline.py's arithmetic: a window's GPU busy time from a kernel trace."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "probe_timeline.py"
_spec = importlib.util.spec_from_file_location("probe_timeline", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_busy_time_is_the_union_of_the_kernels_inside_the_window():
    kernels = [(0, 10), (5, 15), (20, 30), (28, 29), (40, 60)]
    assert probe.busy_us(kernels, 0, 100) == 15 + 10 + 20  # overlaps counted once
    assert probe.busy_us(kernels, 8, 45) == 7 + 10 + 5  # clipped at both ends
    assert probe.busy_us(kernels, 31, 39) == 0
    assert probe.busy_us([], 0, 10) == 0


def _trace() -> list[dict]:
    """Three classic tokens 10 ms apart, each with two 2 ms kernels; rounds 20 ms apart."""
    ev = []
    for i in range(4):
        ev.append({"cat": "user_annotation", "name": "token", "ts": i * 10_000, "dur": 1})
        ev += [{"cat": "kernel", "name": "k", "ts": i * 10_000 + 1000 + j * 3000, "dur": 2000}
               for j in range(2)]  # fmt: skip
    for i in range(4):
        ev.append({"cat": "user_annotation", "name": "round", "ts": 50_000 + i * 20_000, "dur": 1})
        ev.append({"cat": "kernel", "name": "k", "ts": 50_000 + i * 20_000, "dur": 15_000})
    ev.append({"cat": "cpu_op", "name": "other", "ts": 0, "dur": 99_999})  # not a kernel
    return ev


def test_windows_span_mark_to_mark_and_leave_out_the_first():
    w = probe.windows(_trace())
    # 4 marks make 3 windows; the first (a prefill, in a real run) is left out
    assert [x["wall_us"] for x in w["token"]] == [10_000, 10_000]
    assert all(x["busy_us"] == 4000 and x["kernels"] == 2 for x in w["token"])
    assert [x["busy_us"] for x in w["round"]] == [15_000, 15_000]
    s = probe.summary(_trace())
    assert s["token"]["busy_share"]["median"] == 0.4 and s["round"]["n"] == 2


def test_a_saved_trace_is_summarised_without_a_gpu(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    out = subprocess.run([sys.executable, str(_PATH), "--summary", str(path)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(out.stdout)["round"]["busy_ms"]["median"] == 15.0
