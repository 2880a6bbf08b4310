"""Shared fixtures: tiny checkpoints written once per test run in every layout users have."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network

from mtpcli import kernels  # noqa: E402
from mtpcli.fixtures import (  # noqa: E402
    build_drafter,
    build_target,
    tiny_text_config,
    write_drafter,
    write_target,
)
from mtpcli.models import qwen3_5 as tm  # noqa: E402

PREDICTABLE = 0.45  # target mix: drafts accepted often, not always


class Checkpoints:
    """Lazily written checkpoints, keyed by what they are."""

    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[tuple, Path] = {}

    def target(self, *, moe=False, bits=None, layout="mlx", predictable=PREDICTABLE, shards=1,
               seed=0, head_scale=1.0) -> Path:  # fmt: skip
        key = ("t", moe, bits, layout, predictable, shards, seed, head_scale)
        if key not in self._cache:
            name = "-".join(str(k) for k in key)
            text = tiny_text_config(moe=moe)
            model = build_target(text, seed=seed, predictable=predictable, head_scale=head_scale)
            drafter = build_drafter(text, predictable=predictable) if layout == "raw" else None
            self._cache[key] = write_target(
                self.root / name, text, layout=layout, bits=bits, shards=shards, model=model,
                drafter=drafter,
            )  # fmt: skip
        return self._cache[key]

    def drafter(self, *, moe=False, bits=None, predictable=PREDICTABLE, block_size=3,
                seed=1) -> Path:  # fmt: skip
        key = ("d", moe, bits, predictable, block_size, seed)
        if key not in self._cache:
            name = "-".join(str(k) for k in key)
            self._cache[key] = write_drafter(
                self.root / name, tiny_text_config(moe=moe), bits=bits, predictable=predictable,
                block_size=block_size, seed=seed,
            )  # fmt: skip
        return self._cache[key]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="session")
def pair_cache():
    return {}


@pytest.fixture(scope="session")
def load(ckpts, pair_cache):
    """load(moe=..., bits=..., drafter='predictable'|'random') -> Loaded, cached per test run."""
    from mtpcli.loading import load_pair

    def _load(*, moe=False, bits=None, drafter="predictable", drafter_bits=None, head_scale=1.0):
        key = (moe, bits, drafter, drafter_bits, head_scale)
        if key not in pair_cache:
            pred = PREDICTABLE if drafter == "predictable" else None
            t = ckpts.target(moe=moe, bits=bits, head_scale=head_scale)
            d = ckpts.drafter(moe=moe, bits=drafter_bits, predictable=pred, seed=1 if pred else 5)
            pair_cache[key] = load_pair(str(t), str(d))
        return pair_cache[key]

    return _load


@pytest.fixture(autouse=True)
def _example_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mtp-cache"))


@pytest.fixture
def tiny_mixer():
    """mlx-lm's gated-delta mixer of a tiny shape, an input x [1, 3, 64], an empty conv window
    and state, and x plus the mixer's output (what our layer's mixer part must give)."""
    import mlx.core as mx
    from mlx_lm.models import qwen3_5 as mlx_qwen

    args = mlx_qwen.TextModelArgs(
        model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
        vocab_size=64, linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        full_attention_interval=4,
    )  # fmt: skip
    m = mlx_qwen.GatedDeltaNet(args)
    x = mx.random.normal((1, 3, 64), key=mx.random.key(2))
    conv_state, state = mx.zeros((1, 3, m.conv_dim)), mx.zeros((1, 2, 32, 32))
    return m, x, conv_state, state, x + m(x, cache=None)


@pytest.fixture
def pretend_gpu(monkeypatch):
    """pretend_gpu(module, name, native): a kernel module reports a GPU backend and its native
    function ``name`` is ``native`` (a fake); entries called in auto mode self-check it."""

    def _pretend(module, name, native):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
        monkeypatch.setattr(module, name, native)

    return _pretend


def length_attention(q, k, v, gate, q_norm, k_norm, eps, keys, values, rope, scale,
                     mode="auto", length=None):  # fmt: skip
    """``decode_attention``'s contract on the cache's buffers and their length (an int32 [1]
    array), in MLX ops that never read the length back: position t attends the buffers' first
    N rows and the block's first t + 1 keys (the rest masked)."""
    B, T, Hq, D = q.shape
    N = length[0]
    q = mx.fast.rms_norm(q, q_norm, eps).transpose(0, 2, 1, 3)  # [B, Hq, T, D]
    k = mx.fast.rms_norm(k, k_norm, eps).transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    q, k = (mx.fast.rope(x, rope.dims, traditional=False, base=rope.base, scale=rope.scale,
                         offset=N) for x in (q, k))  # fmt: skip
    # T rows of room past the buffers (which need not have them: the cache grows after this)
    keys, values = (mx.concatenate([a, mx.zeros((*a.shape[:2], T, D), a.dtype)], axis=2)
                    for a in (keys, values))  # fmt: skip
    keys = mx.slice_update(keys, k, length, axes=(2,))
    values = mx.slice_update(values, v.transpose(0, 2, 1, 3), length, axes=(2,))
    seen = mx.arange(keys.shape[2])[None] <= (N + mx.arange(T))[:, None]  # [T, capacity]
    o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=seen)
    o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)  # [B, T, Hq * D]
    return o * mx.sigmoid(gate.reshape(B, T, -1)), k


def rows_length_attention(q, k, v, gate, q_norm, k_norm, eps, keys, values, lengths, rope,
                          scale, mode="auto"):  # fmt: skip
    """``decode_attention_rows``' contract: row b of the batch's buffers at its own length
    ``lengths[b]``, each as ``length_attention`` (a row at a time, in ops)."""
    outs = [length_attention(*(x[b : b + 1] for x in (q, k, v, gate)), q_norm, k_norm, eps,
                             keys[b : b + 1], values[b : b + 1], rope, scale,
                             length=lengths[b : b + 1]) for b in range(q.shape[0])]  # fmt: skip
    return tuple(mx.concatenate(part, axis=0) for part in zip(*outs, strict=True))


@pytest.fixture
def gpu_paths(monkeypatch):
    """The model's GPU choices on the CPU: the attention kernels' path (as above) for every
    decode step and verify block, and for a batch of requests' rows at their own lengths,
    trusted as the native kernels are once checked."""
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(tm, "decode_attention", length_attention)
    monkeypatch.setattr(tm, "decode_attention_rows", rows_length_attention)
    monkeypatch.setattr(tm, "native_block", lambda *a, **k: True)
    monkeypatch.setattr(tm, "native_rows", lambda *a, **k: True)
