"""scripts/bench_verify.py's decode arms and report: each arm of ours runs the weights it was
given under its options, and decodes what the target decodes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mtpcli import synthetic

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_verify.py"
_spec = importlib.util.spec_from_file_location("bench_verify", _PATH)
bv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bv)


@pytest.fixture(scope="module")
def target():
    return synthetic.build("tiny", bits=4)[0]


def test_every_arm_of_ours_decodes_the_targets_tokens(target):
    from mtpcli.engine.classic import generate_classic

    prompt = [3, 5, 7, 11]
    want = list(generate_classic(target, prompt, max_tokens=6))
    arms = bv.decode_arms(target)
    assert {"ours", "ours_eager", "ours_unfused", "ours_mlx_qmm", "mlx_lm"} <= set(arms)
    for name, (setting, run) in arms.items():
        with setting():
            tps, spread = run(prompt, 6)
        assert tps > 0 and spread["p50"] > 0, name
    eager = bv.eager(target)
    assert not eager.options.compile and target.options.compile  # the original untouched
    assert list(generate_classic(eager, prompt, max_tokens=6)) == want
    assert not eager.functions.compiled_keys()


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
