"""The whole decoder as one compiled graph (a GPU's path once every choice settled): the same
tokens as the layer-by-layer path, classic and MTP, with the attention caches written at their
length on the device. Run on the CPU with the backend reported as CUDA and the kernels'
attention replaced by an ops version that, like the kernels, reads the length from an array."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp
from mtpcli.loading import load_pair
from mtpcli.models import kv_cache

PROMPTS = [[72, 101, 108, 108, 111], [(i * 37) % 250 for i in range(40)]]


def _fresh(ckpts, **kw):
    """A pair of its own (the session's cached pairs must not keep graphs traced here)."""
    return load_pair(str(ckpts.target(**kw)), str(ckpts.drafter(**kw)))


@pytest.mark.parametrize("bits", [None, 4], ids=["bf16", "4bit"])
def test_graph_tokens_equal_the_layer_by_layer_path(ckpts, gpu_paths, monkeypatch, bits):
    loaded = _fresh(ckpts, bits=bits)
    target = loaded.target
    layers = target.with_options(replace(target.options, graph=False))  # the same weights
    want = [list(generate_classic(layers, p, max_tokens=40)) for p in PROMPTS]
    assert not layers.graph_lengths and not target.graph_lengths
    for p, w in zip(PROMPTS, want, strict=True):
        assert list(generate_classic(target, p, max_tokens=40)) == w
        got = generate_mtp(target, loaded.drafter, p, block_size=3, max_tokens=40)
        assert list(got) == w
    assert {(1, False), (3, True)} <= target.graph_lengths


def test_a_graph_that_writes_the_cache_one_row_off_changes_the_tokens(ckpts, gpu_paths,
                                                                      monkeypatch):  # fmt: skip
    loaded = _fresh(ckpts)
    want = [list(generate_classic(loaded.target, p, max_tokens=40)) for p in PROMPTS]
    write = kv_cache.GraphKV.write

    def off_by_one(self, keys, values):
        self._length = self._length + 1
        write(self, keys, values)

    monkeypatch.setattr(kv_cache.GraphKV, "write", off_by_one)
    fresh = _fresh(ckpts)
    got = [list(generate_classic(fresh.target, p, max_tokens=40)) for p in PROMPTS]
    assert got != want


def test_buffers_grow_outside_the_graph(ckpts, gpu_paths):
    """A generation past the buffers' first 256 rows grows them before a step, not in it."""
    loaded = _fresh(ckpts)
    prompt = [(i * 13) % 250 for i in range(250)]
    classic = list(generate_classic(loaded.target, prompt, max_tokens=20))
    mtp = list(generate_mtp(loaded.target, loaded.drafter, prompt, block_size=3, max_tokens=20))
    assert mtp == classic and len(classic) == 20
    cache = loaded.target.make_cache()
    loaded.target.prefill(mx.array([prompt]), cache)
    kv = next(c for c in cache if isinstance(c, kv_cache.RowsKVCache))
    assert kv.keys.shape[2] == 256
    kv.reserve(7)
    assert kv.keys.shape[2] == 512 and kv.offset == 250
