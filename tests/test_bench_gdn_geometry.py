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


def _profile(order: list, durations_ns: list[int]) -> str:
    rows = [f'"{i}","mtp_gated_delta_conv","gpu__time_duration.sum","ns","{ns:,}"'
            for i, ns in enumerate(durations_ns)]  # fmt: skip
    line = json.dumps({"order": order, "bitwise_vs_first": {}})
    return "\n".join(["==PROF== Connected to process 7", HEADER, *rows, line]) + "\n"


def test_each_launch_is_read_back_as_its_geometry_and_case():
    order = [[[4, 2, 6], 1, False], [[4, 2, 6], 3, True], [[8, 2, 3], 1, False],
             [[8, 2, 3], 3, True]]  # fmt: skip
    ns = []
    for base in (8000, 12000, 9000, 10000):  # each launch's repeats around its own value
        ns += [base + 10 * j for j in range(geo.REPEATS)]
    out = geo.summary(_profile(order, ns))["us_median_min_max"]
    assert out["(4, 2, 6)"]["T3 states"] == pytest.approx([12.02, 12.0, 12.04])
    assert out["(8, 2, 3)"]["T1"] == pytest.approx([9.02, 9.0, 9.04])
    assert out["(8, 2, 3)"]["T3 states"][0] == pytest.approx(10.02)


def test_a_profile_that_does_not_match_the_order_is_refused():
    order = [[[4, 2, 6], 1, False], [[8, 2, 3], 1, False]]
    with pytest.raises(SystemExit, match="3 kernels profiled, the plan has 2 x"):
        geo.summary(_profile(order, [1000, 1000, 1000]))
    with pytest.raises(SystemExit, match="not a sweep's profile"):
        geo.summary(HEADER + "\n")
