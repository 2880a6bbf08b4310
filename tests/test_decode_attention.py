"""One query's attention (q/k norms, RoPE, the product over the cache, the output gate) as two
launches: the kernels' logic in CPU emulation (CUDA and Metal spellings of one text), the
self-check and fallback (with fakes), the model's one-position path, and on CUDA the kernels."""

from __future__ import annotations

import cuda_emulation  # tests/cuda_emulation.py
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mtpcli import kernels
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp
from mtpcli.kernels import decode_attention as da

cuda = pytest.mark.skipif(not kernels.available("cuda"), reason="needs MLX's CUDA backend")
emulated = pytest.mark.skipif(not cuda_emulation.available(), reason="needs g++")
EPS = 1e-6
ROPE = da.Rope(64, 1e7, 1.0)


@pytest.fixture(autouse=True)
def fresh_verdicts():
    kernels.reset_verdicts()
    yield
    kernels.reset_verdicts()


def _inputs(dtype=mx.bfloat16, B=2, Hq=6, Hkv=2, N=20, D=128, seed=0, T=1):
    """q [B, T, Hq, D] and gate, strided views into one projection row (as the model has them);
    k, v [B, T, Hkv, D]; the norms' weights; keys and values [B, Hkv, N, D], views into a longer
    buffer (as mlx-lm's KVCache holds them)."""
    ks = mx.random.split(mx.random.key(seed), 6)
    qg = (mx.random.normal((B, T, Hq, 2 * D), key=ks[0]) * 2).astype(dtype)
    q, gate = qg[..., :D], qg[..., D:]
    k = (mx.random.normal((B, T, Hkv, D), key=ks[1]) * 2).astype(dtype)
    v = mx.random.normal((B, T, Hkv, D), key=ks[2]).astype(dtype)
    qw, kw = (mx.random.uniform(0.5, 1.5, (D,), key=key).astype(dtype)
              for key in mx.random.split(ks[3]))  # fmt: skip
    buffer = mx.random.normal((2, B, Hkv, N + 9, D), key=ks[4]).astype(dtype)
    return q, k, v, gate, qw, kw, buffer[0, :, :, :N], buffer[1, :, :, :N]


def _rows(args: tuple, length) -> tuple:
    """A native kernel's arguments with the cache's buffers cut to their ``length`` rows."""
    return (*args[:7], *da._rows(args[7], args[8], length), *args[9:])


def _ops(args, scale):
    return da.decode_attention_ops(*args[:6], EPS, *args[6:], ROPE, scale)


def _emulated(
    args, scale, metal=False, partial=None, buffers=None, lengths=None
) -> tuple[np.ndarray, np.ndarray]:
    """(out, new key) of the two kernels in emulation: bf16 bits (CUDA) or float32 (Metal).
    ``buffers`` (keys, values): longer buffers whose first N rows are args' keys and values,
    given to the kernels in their place with N as their ``cached`` input (the model's way).
    ``lengths``: each row's own N instead (a batch of requests)."""
    q, k, v, gate, qw, kw, keys, values = args
    B, T, Hq, D = q.shape
    N = keys.shape[2]
    names = ["q", "k", "v", "q_norm", "k_norm", "keys", "values"]
    kv = buffers or (keys, values)
    given = dict(zip(names, args[:3] + args[4:6] + tuple(kv), strict=True))
    if metal:
        host = {n: np.array(a.astype(mx.float32)) for n, a in given.items()}
        host_gate, constants, types = np.array(gate.astype(mx.float32)), {"InT": "float"}, None
    else:
        host = {n: np.array(a.view(mx.uint16)) for n, a in given.items()}
        host_gate, constants = np.array(gate.view(mx.uint16)), {"InT": "__nv_bfloat16"}
        types = dict.fromkeys(names + ["gate"], "InT")
    cached = np.array([N] if lengths is None else lengths, np.int32)
    header, partial_src, combine_src = da.sources(metal, EPS, ROPE, scale)
    shapes = da.launch_shapes(B, T, Hq, k.shape[2], D)
    parts = cuda_emulation.run(
        partial or partial_src, host | {"cached": cached},
        dict(zip(da._PARTIAL_OUTPUTS, shapes["partial_outputs"], strict=True)),
        constants | {"D": D, "WARPS": da._WARPS}, shapes["partial_grid"],
        shapes["partial_threadgroup"], header=header, types=types,
    )  # fmt: skip
    combined = cuda_emulation.run(
        combine_src,
        {n: parts[n] for n in da._PARTIAL_OUTPUTS[:3]} | {"gate": host_gate, "cached": cached},
        {"out": shapes["combine_outputs"][0]}, constants | {"D": D}, shapes["combine_grid"],
        shapes["combine_threadgroup"], header=header, types=types and {"gate": "InT"},
    )  # fmt: skip
    return combined["out"], parts["k_out"]


@emulated
def test_emulated_rows_each_read_their_own_length():
    """A batch of requests: rows in one buffer at their own lengths (one split and three),
    each row bitwise the kernels on that row alone; one length for both rows differs."""
    args = _inputs(B=2, N=40, Hq=2, Hkv=1, D=64)
    lengths = [5, 37]
    got = _emulated(args, 128**-0.5, buffers=args[6:], lengths=lengths)
    for b, n in enumerate(lengths):
        row = tuple(a[b : b + 1] for a in args[:4]) + args[4:6]
        alone = _emulated((*row, args[6][b : b + 1, :, :n], args[7][b : b + 1, :, :n]),
                          128**-0.5)  # fmt: skip
        for a, want in zip(got, alone, strict=True):
            assert np.array_equal(a[b : b + 1], want)
    same = _emulated(args, 128**-0.5, buffers=args[6:], lengths=[37])
    assert not np.array_equal(same[0][:1], got[0][:1])


@emulated
@pytest.mark.parametrize("N", [40])  # three splits a position; one split: the tests below
def test_emulated_kernels_read_the_cache_length_from_their_input(N):
    """The cache as the first N rows of a longer buffer, N given as an input (as the model's
    graph gives it): bitwise the kernels on the N rows alone; a wrong N changes the output."""
    args = _inputs(B=1, N=N, Hq=2, Hkv=1, T=3)  # batches and head groups: the reference test
    ks = mx.random.split(mx.random.key(99), 2)
    pad = [mx.random.normal((*a.shape[:2], 11, a.shape[3]), key=key).astype(a.dtype)
           for a, key in zip(args[6:], ks, strict=True)]  # fmt: skip
    buffers = tuple(mx.concatenate([a, p], axis=2) for a, p in zip(args[6:], pad, strict=True))
    want = _emulated(args, 128**-0.5)
    got = _emulated(args, 128**-0.5, buffers=buffers)
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)
    longer = (*args[:6], buffers[0][:, :, : N + 1], buffers[1][:, :, : N + 1])
    assert not np.array_equal(_emulated(longer, 128**-0.5)[0], want[0])


@emulated
@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
@pytest.mark.parametrize("N,Hq,Hkv,T", [(1, 2, 1, 1), (40, 6, 2, 1), (14, 2, 1, 3)])
def test_emulated_kernels_match_the_reference(metal, N, Hq, Hkv, T):
    """One split and several (N + 1 = 41 keys: 3), grouped queries, the cache a view; a block
    of 3 positions whose keys cross a split's edge (15, 16, 17 keys: 1, 1, 2 splits)."""
    args = _inputs(N=N, Hq=Hq, Hkv=Hkv, T=T)
    scale = 128**-0.5
    assert da.splits(N + 1) == (N + 16) // 16
    out, k_new = _emulated(args, scale, metal)
    if metal:  # float32 in and out: the float32 reference, to float32 roundings
        args = tuple(a.astype(mx.float32) for a in args)
    want_out, want_k = (np.array(a.astype(mx.float32)) for a in _ops(args, scale))
    # bf16: a rounding or two apart (the norm's, the rotation's, the output's)
    tol = 2e-3 if metal else 2e-2
    np.testing.assert_allclose(out, want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(k_new, want_k, rtol=tol, atol=tol)


@emulated
@pytest.mark.parametrize(
    "mistake,T",
    [
        (("int j = j0 + warp; j < j1;", "int j = j0 + warp; j < j1 - 1;"), 1),  # no new key
        (("x1 * s + x2 * c", "x1 * s - x2 * c"), 1),  # the wrong rotation
        (("expf(red_m[w] - M), a)", "1.0f, a)"), 1),  # the warps' partials merged unscaled
        (("hk * keys_strides[1]", "hk * keys_strides[2]"), 1),  # the cache through wrong strides
        (("static_cast<float>(N + t)", "static_cast<float>(N)"), 3),  # every query at position N
        (("u * k_strides[1]", "0 * k_strides[1]"), 3),  # the block's first key for all of them
        (("(blk % total) / MAX_SPLITS;", "0;"), 3),  # every split given to the first position
    ],
)
def test_emulation_catches_a_broken_kernel(mistake, T):
    # The block's mistakes on one KV head (half the emulated threadgroups); the strides' one
    # needs two heads to show. Head dim 64: the rotary embedding's every feature.
    args = _inputs(B=1, N=40, Hq=2, Hkv=2 if T == 1 else 1, T=T, D=64)
    scale = 128**-0.5
    header, partial, _ = da.sources(False, EPS, ROPE, scale)
    text = partial if mistake[0] in partial else header
    assert text.count(mistake[0]) == 1
    broken = partial.replace(*mistake) if text is partial else None
    if broken is None:  # a header mistake: splice it through the sources the test runs
        original = da._HEADER
        try:
            da._HEADER = original.replace(*mistake)
            bad = _emulated(args, scale)[0]
        finally:
            da._HEADER = original
    else:
        bad = _emulated(args, scale, partial=broken)[0]
    if T not in _GOOD:  # the intact kernels' output, once a block length
        _GOOD[T] = _emulated(args, scale)[0]
    assert not np.allclose(bad, _GOOD[T], rtol=2e-2, atol=2e-2)


_GOOD: dict[int, np.ndarray] = {}


@emulated
@pytest.mark.parametrize("N", [14])  # the block's keys cross a split's edge: 15, 16, 17 keys
def test_emulated_block_rows_equal_one_position_launches(N):
    """A verify block's rows are bitwise what decode steps at those positions compute: the
    kernels on a block of 3, against the kernels on one position at a time, each step's new key
    (the kernel's own output) and value appended to the cache as the model's cache does."""
    q, k, v, gate, qw, kw, keys, values = args = _inputs(B=1, N=N, Hq=2, Hkv=1, T=3)
    scale = 128**-0.5
    out, k_new = _emulated(args, scale)
    for t in range(3):
        row = tuple(x[:, t : t + 1] for x in (q, k, v, gate))
        o, kt = _emulated(row + (qw, kw, keys, values), scale)
        assert np.array_equal(o, out[:, t : t + 1]), f"position {t}"
        assert np.array_equal(kt, k_new[:, :, t : t + 1]), f"position {t}"
        kt = mx.array(kt).astype(mx.bfloat16)  # exact: the kernel stored bf16 values
        keys = mx.concatenate([keys, kt], axis=2)
        values = mx.concatenate([values, v[:, t : t + 1].transpose(0, 2, 1, 3)], axis=2)


def test_both_spellings_are_one_text():
    """The Metal kernels mirror the CUDA kernels line by line (only spelled tokens differ)."""
    for cuda_text, metal_text in zip(da.sources(False, EPS, ROPE, 0.0625),
                                     da.sources(True, EPS, ROPE, 0.0625), strict=True):  # fmt: skip
        a, b = cuda_text.splitlines(), metal_text.splitlines()
        assert len(a) == len(b)
        spelled = [t for t in kernels._SPELLINGS[True].values() if t]
        spelled += ["thread_position_in_threadgroup", "thread_index_in_simdgroup",
                    "simdgroup_index_in_threadgroup", "threadgroup_position_in_grid"]  # fmt: skip
        differ = [y for x, y in zip(a, b, strict=True) if x != y]
        assert differ and all(any(t in y for t in spelled) for y in differ), differ


def test_rope_spec_only_for_what_the_kernel_does():
    assert da.Rope.of(nn.RoPE(64, base=1e7)) == da.Rope(64, 1e7, 1.0)
    assert da.Rope.of(nn.RoPE(64, traditional=True)) is None
    assert da.Rope.of(nn.Identity()) is None


def test_a_correct_kernel_is_trusted_and_used(pretend_gpu):
    calls = []

    def native(*args, length=None):
        args = _rows(args, length)
        calls.append(args[7].shape)  # the cache's keys
        return da.decode_attention_ops(*args)

    pretend_gpu(da, "decode_attention_native", native)
    args = _inputs(N=33)
    out = da.decode_attention(*args[:6], EPS, *args[6:], ROPE, 0.0625)
    assert calls[-1] == args[6].shape  # after the self-check's calls
    for a, b in zip(out, _ops(args, 0.0625), strict=True):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("wrong", ["output", "new key"])
def test_a_wrong_kernel_is_refused_with_a_warning(pretend_gpu, wrong):
    def native(*args, length=None):
        args = _rows(args, length)
        out, k = da.decode_attention_ops(*args)
        if args[7].shape[2] < 100:  # right for a short cache only: the check tries a long one
            return out, k
        return (out * 1.5, k) if wrong == "output" else (out, k * 1.5)

    pretend_gpu(da, "decode_attention_native", native)
    args = _inputs(N=33)
    with pytest.warns(RuntimeWarning, match="decode_attention kernel disagrees"):
        out = da.decode_attention(*args[:6], EPS, *args[6:], ROPE, 0.0625)
    for a, b in zip(out, _ops(args, 0.0625), strict=True):
        assert mx.array_equal(a, b).item()


def test_a_block_whose_rows_differ_goes_position_by_position(pretend_gpu):
    """Right alone, a last-bit skew in a block's rows: blocks are refused (with a warning) and
    run as one-position launches of the same kernels, which are still trusted."""
    calls = []

    def native(*args, length=None):
        args = _rows(args, length)
        calls.append(args[0].shape[1])
        out, k = da.decode_attention_ops(*args)
        return (out * (1 + 2**-7), k) if args[0].shape[1] > 1 else (out, k)

    pretend_gpu(da, "decode_attention_native", native)
    args = _inputs(N=33, T=3)
    with pytest.warns(RuntimeWarning, match="decode_attention_block kernel disagrees"):
        out = da.decode_attention(*args[:6], EPS, *args[6:], ROPE, 0.0625)
    assert calls[-3:] == [1, 1, 1]
    for a, b in zip(out, _ops(args, 0.0625), strict=True):
        assert mx.array_equal(a, b).item()


def test_a_block_runs_in_one_launch_pair_once_trusted(pretend_gpu):
    calls = []

    def native(*args, length=None):
        args = _rows(args, length)
        calls.append(args[0].shape[1])
        return da.decode_attention_ops(*args)

    pretend_gpu(da, "decode_attention_native", native)
    args = _inputs(N=33, T=3)
    out = da.decode_attention(*args[:6], EPS, *args[6:], ROPE, 0.0625)
    assert calls[-1] == 3
    for a, b in zip(out, _ops(args, 0.0625), strict=True):
        assert mx.array_equal(a, b).item()


def test_the_model_takes_the_kernel_path_on_a_gpu_and_stays_exact(load, monkeypatch):
    """With the backend reported as a GPU, decode steps and MTP's verify blocks go through
    ``decode_attention`` (its reference here, a block position by position), and give the
    general path's tokens. A wrong result there changes the tokens."""
    from mtpcli.models import qwen3_5 as tm

    loaded = load()
    prompts = [[72, 101, 108, 108, 111], [(i * 37) % 250 for i in range(40)]]
    want = [list(generate_classic(loaded.target, p, max_tokens=24)) for p in prompts]
    calls = []

    def counted(*args, **kw):
        calls.append(args[0].shape[1])  # positions
        return da.decode_attention(*args, **kw)

    monkeypatch.setattr(kernels, "backend", lambda: "cuda")  # what attention_core asks
    monkeypatch.setattr(tm, "decode_attention", counted)
    for p, w in zip(prompts, want, strict=True):
        assert list(generate_classic(loaded.target, p, max_tokens=24)) == w
        got = generate_mtp(loaded.target, loaded.drafter, p, block_size=3, max_tokens=24)
        assert list(got) == w
    assert calls.count(1) >= 2 * 23 and max(calls) == 3  # decode steps, and verify blocks

    def dropped_key(*args, length=None):  # the new position's own key left out of the product
        args = _rows(args[:11], length)  # the cache's rows, without the kernel mode
        out, k = da.decode_attention_ops(*args)
        q, kk, v, gate, qw, kw, eps, keys, values, rope, scale = args
        wrong, _ = da.decode_attention_ops(q, kk, v, gate, qw, kw, eps, keys[:, :, 1:],
                                           values[:, :, 1:], rope, scale)  # fmt: skip
        return wrong if keys.shape[2] > 1 else out, k

    monkeypatch.setattr(tm, "decode_attention", dropped_key)
    got = [list(generate_classic(loaded.target, p, max_tokens=24)) for p in prompts]
    assert got != want


class _GpuDefault:
    """mlx.core as the model module sees it, with a GPU as the default device (the GPU
    verify's choices, made on the CPU)."""

    def __getattr__(self, name):
        return getattr(mx, name)

    def default_device(self):
        return mx.Device(mx.gpu)


@pytest.mark.parametrize("rope", ["kernel's", "other"])
def test_a_gpu_verify_runs_attention_as_a_block_only_through_the_kernel_path(load, monkeypatch,
                                                                            rope):  # fmt: skip
    """On a GPU a verify block's attention is one call (rows exact by construction) where the
    kernel path takes the layer; with a rotary kind it does not do, MLX's batched GPU
    attention is not trusted and the block goes position by position. MTP equals classic."""
    from mtpcli.models import qwen3_5 as tm

    loaded = load()
    prompt = [(i * 37) % 250 for i in range(40)]
    want = list(generate_classic(loaded.target, prompt, max_tokens=24))
    seen = []
    original = tm.attention_core

    def recorded(m, q, k, v, gate, mask, cache, mode="auto"):
        seen.append((q.shape[1], cache.offset))
        return original(m, q, k, v, gate, mask, cache, mode)

    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(tm, "mx", _GpuDefault())
    monkeypatch.setattr(tm, "attention_core", recorded)
    if rope == "other":
        monkeypatch.setattr(tm.Rope, "of", classmethod(lambda cls, module: None))
    got = generate_mtp(loaded.target, loaded.drafter, prompt, block_size=3, max_tokens=24)
    assert list(got) == want
    blocks = [T for T, offset in seen if T > 1 and offset > 0]  # not the prompt's prefill
    assert blocks if rope == "kernel's" else not blocks


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_cuda_block_rows_equal_one_position_launches(dtype):
    for N in (1, 14, 300):
        args = _inputs(dtype, B=1, Hq=24, Hkv=4, N=N, D=256, seed=N, T=4)
        full = (*args[:6], EPS, *args[6:], ROPE, 0.0625)
        block = da.decode_attention_native(*full)
        steps = da.one_at_a_time(da.decode_attention_native, *full)
        for a, b in zip(block, steps, strict=True):
            assert mx.array_equal(a, b).item(), f"N = {N}"


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_cuda_kernels_match_the_reference(dtype):
    assert da._self_check(dtype, dtype, 256, EPS, ROPE, 0.0625) is None
    for N in (1, 15, 16, 300, 2000):  # one split, a split's edge, many, the most
        args = _inputs(dtype, B=1, Hq=24, Hkv=4, N=N, D=256, seed=N)
        got = da.decode_attention_native(*args[:6], EPS, *args[6:], ROPE, 0.0625)
        again = da.decode_attention_native(*args[:6], EPS, *args[6:], ROPE, 0.0625)
        want = _ops(args, 0.0625)
        for a, b, c in zip(got, want, again, strict=True):
            assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=2e-2,
                               atol=2e-2).item(), f"N = {N}"  # fmt: skip
            assert mx.array_equal(a, c).item(), f"N = {N}: not deterministic"


@cuda
@pytest.mark.parametrize("T", [1, 3])
def test_cuda_rows_at_their_own_lengths_equal_each_row_alone(T):
    """A batch of requests in one launch pair, each row at its own length (one split, an
    edge, many): bitwise the launch on that row alone; the entry takes this path."""
    args = _inputs(mx.bfloat16, B=3, Hq=24, Hkv=4, N=400, D=256, seed=T, T=T)
    lengths = [1, 16, 377]
    got = da.decode_attention_rows(*args[:6], EPS, *args[6:], mx.array(lengths, mx.int32),
                                   ROPE, 0.0625)  # fmt: skip
    assert got is not None
    for b, n in enumerate(lengths):
        row = (*(x[b : b + 1] for x in args[:4]), *args[4:6], EPS)
        alone = da.decode_attention_native(*row, args[6][b : b + 1], args[7][b : b + 1], ROPE,
                                           0.0625, length=mx.array([n], mx.int32))  # fmt: skip
        for a, want in zip(got, alone, strict=True):
            assert mx.array_equal(a[b : b + 1], want).item(), f"row {b} at {n}"
