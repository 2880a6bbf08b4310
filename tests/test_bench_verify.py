"""scripts/bench_verify.py's decode arms: each setting switches what it names and puts it back,
and a switch that no longer exists is caught when the arms are made, not mid-run on a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mtpcli import synthetic
from mtpcli.kernels import gated_delta as gd
from mtpcli.kernels import quantized_matmul as qm
from mtpcli.models import qwen3_5 as tm

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_verify.py"
_spec = importlib.util.spec_from_file_location("bench_verify", _PATH)
bv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bv)

WATCHED = {gd: ["FUSE_CONV", "conv_silu"],
           qm: ["FUSE_GATE", "gated_norm_in_place", "FUSE_RESIDUAL", "FUSE_NORM",
                "FUSE_SWIGLU", "BEGIN_NORMS"],
           tm: ["decode_attention"]}  # fmt: skip


def _snapshot() -> dict:
    return {(m.__name__, n): getattr(m, n) for m, names in WATCHED.items() for n in names}


@pytest.fixture(scope="module")
def target():
    return synthetic.build("tiny", bits=4)[0]


def test_every_arm_setting_enters_and_restores(target):
    before = _snapshot()
    arms = bv.decode_arms(target)
    assert {"ours", "mlx_lm", "ours_gated_norm_ops", "ours_conv_ops"} <= set(arms)
    switched = set()
    for setting, _ in arms.values():
        with setting():
            now = _snapshot()
            switched |= {key for key in now if now[key] is not before[key]}
        assert _snapshot() == before
    # the arms between them switch every watched name (a setting that does nothing would not)
    assert switched == set(before)


def test_a_switch_that_does_not_exist_is_refused_when_made():
    with pytest.raises(AttributeError, match="gated_norm"):
        bv._patched(qm, gated_norm=None)


def test_the_gated_norm_ops_arm_runs_the_reference_and_decodes_the_same(target, monkeypatch):
    from mtpcli.engine.classic import generate_classic

    prompt = [3, 5, 7, 11]
    want = list(generate_classic(target, prompt, max_tokens=6))
    calls = []
    reference = bv.gn.gated_norm_ops
    monkeypatch.setattr(bv.gn, "gated_norm_ops", lambda *a: calls.append(1) or reference(*a))
    setting, _ = bv.decode_arms(target)["ours_gated_norm_ops"]
    with setting():
        got = list(generate_classic(target, prompt, max_tokens=6))
    assert calls, "the arm did not reach the norm's ops reference"
    assert got == want


def _part(total, delta, attn, mm):
    return {"total": total, "gated_delta": delta, "attention": attn, "matmuls": mm,
            "matmuls_if_batched": mm, "rest": total - delta - attn - mm}  # fmt: skip


def test_a_breakdown_with_negative_parts_is_marked_as_none():
    sane = bv._breakdown_lines({1: _part(10.0, 2.0, 1.0, 6.0)})
    assert "| 1 | 10.00 | 2.00 | 1.00 | 6.00 | 6.00 | 1.00 |" in sane
    assert not any("Not a breakdown" in line for line in sane)
    host_bound = bv._breakdown_lines(
        {1: _part(10.0, 2.0, 1.0, 6.0), 3: _part(30.0, 1.0, -2.0, 90.0)}
    )
    assert any("Not a breakdown" in line for line in host_bound)
