"""The prompt's prefill: all but the last token in chunks, the last as a decode step, and for
classic decoding without the chunks' hidden states (the caches are what comes next needs), as
mlx-lm's prefill."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtpcli.engine.classic import generate_classic
from mtpcli.models import qwen3_5 as tm

PROMPT = [(i * 37) % 250 for i in range(40)]


def _bitwise(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


@pytest.mark.parametrize("bits", [None, 4], ids=["bf16", "4bit"])
def test_last_chunk_only_leaves_the_same_caches_and_last_hidden(load, monkeypatch, bits):
    target = load(bits=bits).target
    monkeypatch.setattr(tm, "PREFILL_CHUNK", 16)  # 40 tokens: chunks of 16, 16 and 7, then 1
    tokens = mx.array([PROMPT])
    every, last = target.make_cache(), target.make_cache()
    all_hidden = target.prefill(tokens, every)
    tail = target.prefill(tokens, last, every_position=False)
    assert all_hidden.shape[1] == 40 and tail.shape[1] == 1
    assert _bitwise(tail, all_hidden[:, -1:])
    pairs = list(zip(tm.cache_state(every), tm.cache_state(last), strict=True))
    assert pairs and all(_bitwise(a, b) for a, b in pairs)


def test_classic_tokens_do_not_depend_on_the_chunks(load, monkeypatch):
    target = load(bits=4).target
    whole = list(generate_classic(target, PROMPT, max_tokens=20))
    monkeypatch.setattr(tm, "PREFILL_CHUNK", 16)
    calls = []
    prefill = type(target).prefill

    def spy(self, *a, **k):
        calls.append(k.get("every_position", True))
        return prefill(self, *a, **k)

    monkeypatch.setattr(type(target), "prefill", spy)
    assert list(generate_classic(target, PROMPT, max_tokens=20)) == whole
    assert calls == [False]
