"""Decode steps and verify blocks run mx.compile'd layer functions: same bits as op by op, and
really compiled (not silently eager), retraced when a kernel choice changes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtpcli import kernels
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp

PROMPT = [72, 101, 108, 108, 111, 9, 9, 41]


@pytest.fixture
def compile_setting(monkeypatch):
    def use(choice: str) -> None:
        monkeypatch.setitem(kernels._state, "compile", choice)
        kernels.changed()

    yield use
    kernels.changed()


def _decode_hidden(target, steps: int = 6) -> list[mx.array]:
    cache = target.make_cache()
    target.prefill(mx.array([PROMPT]), cache)
    outs = [target.forward(mx.array([[t]]), cache).hidden for t in range(3, 3 + steps)]
    mx.eval(outs)
    return outs


@pytest.mark.parametrize("moe", [False, True])
def test_compiled_steps_equal_eager_steps_bitwise(load, compile_setting, moe):
    target = load(moe=moe, bits=4).target
    compile_setting("off")
    eager = _decode_hidden(target)
    assert not target.functions.compiled_keys()
    compile_setting("on")
    fast = _decode_hidden(target)
    if all(target.routed_on_gpu):  # GPUs run routed layers op by op (docs/design.md)
        assert not target.functions.compiled_keys(), "a routed layer compiled on a GPU"
    else:
        assert target.functions.compiled_keys(), "the decode steps never compiled"
    assert all(mx.array_equal(a, b).item() for a, b in zip(eager, fast, strict=True))


def test_mtp_compiled_equals_classic_eager(load, compile_setting):
    loaded = load(bits=4)
    compile_setting("off")
    want = list(generate_classic(loaded.target, PROMPT, max_tokens=40))
    compile_setting("on")
    got = list(generate_mtp(loaded.target, loaded.drafter, PROMPT, block_size=3, max_tokens=40))
    assert got == want


def test_a_kernel_change_retraces(load, compile_setting):
    target = load(bits=4).target
    compile_setting("on")
    _decode_hidden(target, 3)
    assert target.functions.compiled_keys()
    kernels.changed()
    target.forward(mx.array([[5]]), target.make_cache())
    assert not target.functions.compiled_keys()  # the first pass after it runs op by op


def test_compiled_drafter_equals_eager_drafter(load, compile_setting):
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

    compile_setting("off")
    eager = chain()
    compile_setting("on")
    chain()  # the first pass at each length runs op by op
    fast = chain()
    assert drafter.functions.compiled_keys()
    assert all(mx.array_equal(a, b).item() for a, b in zip(eager, fast, strict=True))
