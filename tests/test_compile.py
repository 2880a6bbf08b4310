"""Decode steps and verify blocks run mx.compile'd layer functions: same bits as op by op, and
really compiled (not silently eager), and op by op throughout with ``Options(compile=False)``."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp
from mtpcli.models.qwen3_5 import LayerFunctions

PROMPT = [72, 101, 108, 108, 111, 9, 9, 41]


def compiled(*models, on: bool) -> None:
    """Fresh layer functions for each target or drafter, compiled or op by op."""
    for m in models:
        m.functions = LayerFunctions(on)


def _decode_hidden(target, steps: int = 6) -> list[mx.array]:
    cache = target.make_cache()
    target.prefill(mx.array([PROMPT]), cache)
    outs = [target.forward(mx.array([[t]]), cache).hidden for t in range(3, 3 + steps)]
    mx.eval(outs)
    return outs


@pytest.mark.parametrize("moe", [False, True])
def test_compiled_steps_equal_eager_steps_bitwise(load, moe):
    target = load(moe=moe, bits=4).target
    compiled(target, on=False)
    eager = _decode_hidden(target)
    assert not target.functions.compiled_keys()
    compiled(target, on=True)
    fast = _decode_hidden(target)
    if all(target.routed_on_gpu):  # GPUs run routed layers op by op (docs/design.md)
        assert not target.functions.compiled_keys(), "a routed layer compiled on a GPU"
    else:
        assert target.functions.compiled_keys(), "the decode steps never compiled"
    assert all(mx.array_equal(a, b).item() for a, b in zip(eager, fast, strict=True))


def test_mtp_compiled_equals_classic_eager(load):
    loaded = load(bits=4)
    compiled(loaded.target, on=False)
    want = list(generate_classic(loaded.target, PROMPT, max_tokens=40))
    compiled(loaded.target, loaded.drafter, on=True)
    got = list(generate_mtp(loaded.target, loaded.drafter, PROMPT, block_size=3, max_tokens=40))
    assert got == want


def test_the_compile_option_off_runs_every_pass_op_by_op(ckpts):
    from mtpcli.loading import load_pair
    from mtpcli.options import Options

    path, dpath = ckpts.target(bits=4), ckpts.drafter(bits=4, predictable=None, seed=5)
    loaded = load_pair(str(path), str(dpath), options=Options(compile=False))
    list(generate_mtp(loaded.target, loaded.drafter, PROMPT, block_size=3, max_tokens=12))
    assert not loaded.target.functions.compiled_keys()
    assert not loaded.drafter.functions.compiled_keys()
    loaded = load_pair(str(path), str(dpath))  # the default: compiled after the first pass
    list(generate_mtp(loaded.target, loaded.drafter, PROMPT, block_size=3, max_tokens=12))
    assert loaded.target.functions.compiled_keys() and loaded.drafter.functions.compiled_keys()


def test_compiled_drafter_equals_eager_drafter(load):
    loaded = load(bits=4)
    target, drafter = loaded.target, loaded.drafter
    hidden = target.prefill(mx.array([PROMPT]), target.make_cache())

    def chain():  # catch up on the prompt, then four chained one-token steps
        cache = drafter.make_cache()
        h = drafter.forward(mx.array([PROMPT[1:] + [7]]), hidden, cache)[:, -1:]
        outs = [h]
        for t in range(4):
            outs.append(drafter.forward(mx.array([[t + 3]]), outs[-1], cache))
        mx.eval(outs)
        return outs

    compiled(drafter, on=False)
    eager = chain()
    compiled(drafter, on=True)
    chain()  # the first pass at each length runs op by op
    fast = chain()
    assert drafter.functions.compiled_keys()
    assert all(mx.array_equal(a, b).item() for a, b in zip(eager, fast, strict=True))
