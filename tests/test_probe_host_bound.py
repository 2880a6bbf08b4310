"""scripts/probe_host_bound.py --build: the host's build times, each verify block rolled back
to one kept position, as a round that accepts no draft."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "probe_host_bound.py"
_spec = importlib.util.spec_from_file_location("probe_host_bound", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_build_costs_time_each_part_and_profile_the_verify(monkeypatch):
    from mtpcli import synthetic

    target, drafter = synthetic.build("tiny", bits=4)
    offsets, real = [], target.forward

    def forward(tokens, cache, *, verify=False):
        offsets.append((tokens.shape[1], next(c.offset for c in cache if hasattr(c, "offset"))))
        return real(tokens, cache, verify=verify)

    monkeypatch.setattr(target, "forward", forward)
    res = probe.build_costs(target, drafter, list(range(10)), n=3)
    assert set(res["build_ms"]) == {"decode_step", "verify_block_3", "drafts_2"}
    assert all(v > 0 for v in res["build_ms"].values())
    assert set(res["submit_ms"]) == set(res["build_ms"])
    assert all(v > 0 for v in res["submit_ms"].values())
    blocks = [at for T, at in offsets if T == 3]
    assert len(blocks) == 2 * (3 + 4)  # timed, then profiled
    assert blocks == list(range(blocks[0], blocks[0] + len(blocks)))  # one position kept each
    names = [row["function"] for row in res["verify_profile_ms_a_block"]]
    assert any("forward" in name for name in names)
    assert all(row["cumulative"] >= row["own"] >= 0 for row in res["verify_profile_ms_a_block"])
