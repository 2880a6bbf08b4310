"""scripts/bench_gdn_geometry.py's summary: ncu's kernel durations mapped back to the sweep's
launch order (geometry, T, states kept)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_gdn_geometry.py"
_spec = importlib.util.spec_from_file_location("bench_gdn_geometry", _PATH)
geo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(geo)

HEADER = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'


def _profile(order: list, durations_ns: list[int], checks: dict | None = None) -> str:
    rows = [f'"{i}","mtp_gated_delta_conv","gpu__time_duration.sum","ns","{ns:,}"'
            for i, ns in enumerate(durations_ns)]  # fmt: skip
    line = json.dumps({"order": order, "bitwise_vs_first": {}, "checks": checks or {}})
    return "\n".join(["==PROF== Connected to process 7", HEADER, *rows, line]) + "\n"


def test_each_launch_is_read_back_as_its_geometry_and_case(capsys):
    order = [[[4, 2, 6], 1, False], [[4, 2, 6], 3, True], [[8, 2, 3], 1, False],
             [[8, 2, 3], 3, True]]  # fmt: skip
    ns = []
    for base in (8000, 12000, 9000, 10000):  # each launch's repeats around its own value
        ns += [base + 10 * j for j in range(geo.REPEATS)]
    checks = {"(4, 2, 6)": {"chain_bitwise": False, "max_diff_vs_ops": {"y": 0.5}}}
    summary = geo.summary(_profile(order, ns, checks))
    assert summary["checks"] == checks
    out = summary["us_median_min_max"]
    assert out["(4, 2, 6)"]["T3 states"] == pytest.approx([12.02, 12.0, 12.04])
    assert out["(8, 2, 3)"]["T1"] == pytest.approx([9.02, 9.0, 9.04])
    assert out["(8, 2, 3)"]["T3 states"][0] == pytest.approx(10.02)
    assert "(4, 2, 6): T = 3 against 3 chained steps BROKEN" in capsys.readouterr().out


def test_a_profile_that_does_not_match_the_order_is_refused():
    order = [[[4, 2, 6], 1, False], [[8, 2, 3], 1, False]]
    with pytest.raises(SystemExit, match="3 kernels profiled, the plan has 2 x"):
        geo.summary(_profile(order, [1000, 1000, 1000]))
    with pytest.raises(SystemExit, match="not a sweep's profile"):
        geo.summary(HEADER + "\n")


def test_a_step_profile_is_summed_step_by_step():
    """``--step``: each step's launches summed, median (min-max) of the steps, ratio to T = 1."""
    per = 2
    ns = []
    for base in (4000, 5000):  # T = 1, then T = 3
        for j in range(geo.REPEATS):
            ns += [base + 100 * j, base + 100 * j]  # a step: two launches
    text = "\n".join(["==PROF== Connected", HEADER] + [
        f'"{i}","mtp_gated_delta_conv","gpu__time_duration.sum","ns","{x:,}"'
        for i, x in enumerate(ns)
    ] + [json.dumps({"steps": [1, 3], "launches_per_step": per})])  # fmt: skip
    out = geo.summary(text)["ms_median_min_max_ratio"]
    mid = 2 * (geo.REPEATS - 1) // 2 * 100  # the median step's extra ns (two launches)
    assert out["T1"][:3] == pytest.approx([(8000 + mid) / 1e6, 0.008, (8000 + 200 * 4) / 1e6])
    assert out["T3"][3] == pytest.approx((10000 + mid) / (8000 + mid))
    with pytest.raises(SystemExit, match="20 kernels profiled, the plan has 3 x 5 x 2"):
        geo.summary(text.replace('"launches_per_step": 2', '"launches_per_step": 3'))


def _ops_launch(*args, **kw):
    from mtpcli.kernels import gated_delta as gd

    return gd.gated_delta_conv_ops(*args, **kw)


def test_the_chain_check_holds_for_the_reference_and_catches_a_broken_launch():
    """The sweep's GPU check, run here with the ops reference standing in for the kernel: T
    steps at once equal T chained steps; a launch whose block result drifts is caught."""
    good = geo.chain_check(_ops_launch)
    assert good["chain_bitwise"] and max(good["max_diff_vs_ops"].values()) == 0.0

    def drifting(*args, **kw):
        y, state, states, inputs, window = _ops_launch(*args, **kw)
        return y, state * (1 + 1e-6 * (args[0].shape[1] > 1)), states, inputs, window

    bad = geo.chain_check(drifting)
    assert not bad["chain_bitwise"] and bad["max_diff_vs_ops"]["state"] > 0


def test_dumps_are_compared_bitwise(tmp_path):
    import mlx.core as mx

    a = {"T1 keep False 0": mx.arange(6).astype(mx.bfloat16)}
    a_, b_, c_ = (tmp_path / f"{x}.safetensors" for x in "abc")
    mx.save_safetensors(str(a_), a)
    mx.save_safetensors(str(b_), a)
    mx.save_safetensors(str(c_), {"T1 keep False 0": a["T1 keep False 0"] + 1})
    assert geo.compare([a_, b_, c_]) == {str(b_): True, str(c_): False}


def test_another_module_version_runs_in_the_products_place(tmp_path, monkeypatch):
    """``--module``: the file is what the model's import of the gated-delta module then gets."""
    import sys

    import mtpcli.kernels

    name = "mtpcli.kernels.gated_delta"
    monkeypatch.setitem(sys.modules, name, sys.modules[name])  # restored afterwards
    monkeypatch.setattr(mtpcli.kernels, "gated_delta", sys.modules[name])
    monkeypatch.setattr(geo, "gd", geo.gd)
    from mtpcli.models import qwen3_5 as tm

    # imported from the old module before: restored afterwards
    monkeypatch.setattr(tm, "gated_delta_conv", tm.gated_delta_conv)
    source = Path(sys.modules[name].__file__).read_text() + "\nVERSION_MARK = 26\n"
    (tmp_path / "gd_other.py").write_text(source)
    module = geo.use_module(tmp_path / "gd_other.py")
    from mtpcli.kernels import gated_delta

    assert gated_delta is module and module.VERSION_MARK == 26 and geo.gd is module
    # the model imported its function before --module was read: it runs the new module's now
    # (session 27 found --step --module profiling the old one)
    assert tm.gated_delta_conv is module.gated_delta_conv
