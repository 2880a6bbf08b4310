"""Continuous batching (``engine/batch.py``): every row decodes the tokens its request decodes
alone (``generate_classic``, the reference), whatever else shares the batch, joins or leaves.
Mutations show the test can fail: rows kept in the wrong order after one leaves, a sampled row
drawing from MLX's global keys instead of its own chain."""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest

from mtpcli.engine import batch as batch_mod
from mtpcli.engine.batch import Batch
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.sampling import SamplingParams
from mtpcli.errors import BatchNotSupportedError, ContextTooLongError, UsageError

# (prompt, max_tokens, sampling, seed, step it joins at, step its client leaves at)
REQUESTS = [
    ([5, 9, 13, 200, 7], 24, SamplingParams(), None, 0, None),
    ([250, 2, 2, 2, 2, 2, 2, 11, 12], 20, SamplingParams(temp=1.0), 11, 0, None),
    ([44] * 23, 30, SamplingParams(), None, 3, None),  # joins mid-way, prompt of another length
    ([1, 2, 3], 8, SamplingParams(temp=0.8, top_k=5, min_p=0.05), 3, 4, None),  # leaves early
    ([17, 18], 40, SamplingParams(), None, 1, 9),  # its client leaves after 9 steps
]


def _alone(target, prompt, n, sampling, seed) -> list[int]:
    if seed is not None:
        mx.random.seed(seed)
    return list(generate_classic(target, prompt, max_tokens=n, sampling=sampling))


def _batched(target, requests, eos=()) -> dict[int, list[int]]:
    batch, got, step = Batch(target), {i: [] for i in range(len(requests))}, 0
    pending = sorted(range(len(requests)), key=lambda i: requests[i][4])
    while pending or batch.rows:
        while pending and requests[pending[0]][4] <= step:
            i = pending.pop(0)
            prompt, n, sampling, seed, _, _ = requests[i]
            batch.add(prompt, owner=i, max_tokens=n, sampling=sampling, seed=seed, eos_ids=eos)
        if not batch.rows:
            step += 1
            continue
        batch.advance(got)
        step += 1
        batch.drop([r for r in batch.rows if requests[r.owner][5] == step])  # clients leaving
    return got


@pytest.mark.parametrize("moe,bits", [(False, 4), (False, None), (True, 4)],
                         ids=["dense-4bit", "dense-bf16", "moe-4bit"])  # fmt: skip
def test_each_row_decodes_what_its_request_decodes_alone(load, moe, bits):
    target = load(moe=moe, bits=bits).target
    if target.batch_rows == 1:  # a GPU backend where a product here is not row-invariant
        batch = Batch(target)
        batch.add([5, 6], max_tokens=4)
        with pytest.raises(BatchNotSupportedError):
            batch.add([5, 6], max_tokens=4)
        return
    got = _batched(target, REQUESTS)
    for i, (prompt, n, sampling, seed, _, leaves) in enumerate(REQUESTS):
        want = _alone(target, prompt, n, sampling, seed)
        if leaves is not None:  # the rows it decoded before its client left
            assert len(got[i]) < len(want)
            want = want[: len(got[i])]
        assert got[i] == want, f"request {i}"


def test_a_row_ends_at_eos_and_the_others_go_on(load):
    target = load(bits=4).target
    alone = _alone(target, REQUESTS[0][0], 24, SamplingParams(), None)
    eos = alone[5]  # the sixth token of the first request ends it there
    got = _batched(target, REQUESTS[:3], eos=(eos,))
    assert got[0] == alone[: alone.index(eos)]
    for i in (1, 2):
        prompt, n, sampling, seed, _, _ = REQUESTS[i]
        want = _alone(target, prompt, n, sampling, seed)
        assert got[i] == want[: want.index(eos)] if eos in want else got[i] == want


def test_rows_kept_in_the_wrong_order_change_the_tokens(load, monkeypatch):
    """Mutation: after a row leaves, the caches of the rows left are swapped."""
    target = load(bits=4).target
    keep = type(target).keep_rows
    monkeypatch.setattr(type(target), "keep_rows",
                        lambda self, b, rows: keep(self, b, rows[::-1]))  # fmt: skip
    got = _batched(target, REQUESTS)
    assert any(got[i] != _alone(target, *r[:4])[: len(got[i])] for i, r in enumerate(REQUESTS))


def test_a_sampled_row_without_its_own_keys_draws_other_tokens(load, monkeypatch):
    """Mutation: a seeded row draws from MLX's global keys (as every row would without
    ``KeyChain``): its tokens are no longer those of the request alone."""
    target = load(bits=4).target
    requests = [REQUESTS[1], (REQUESTS[1][0], 20, SamplingParams(temp=1.0), 12, 0, None)]
    monkeypatch.setattr(batch_mod, "KeyChain", lambda seed: None)
    got = _batched(target, requests)
    assert any(got[i] != _alone(target, *r[:4]) for i, r in enumerate(requests))


def test_a_request_past_the_context_is_refused_and_the_batch_goes_on(load):
    target = load(bits=4).target
    batch = Batch(target)
    batch.add([5, 6], max_tokens=4)
    limit = target.config.text.max_position_embeddings
    with pytest.raises(ContextTooLongError):
        batch.add([5, 6], max_tokens=limit)
    vocab = target.config.text.vocab_size  # an id past the embedding's rows: refused, named
    for bad in ([5, vocab], [-1, 5]):
        with pytest.raises(UsageError, match="outside the target's vocabulary"):
            batch.add(bad, max_tokens=4)
        with pytest.raises(UsageError, match="outside the target's vocabulary"):
            list(generate_classic(target, bad, max_tokens=4))
    assert len(batch.rows) == 1 and batch.step()[0].tokens


def test_rows_on_our_product_are_capped_where_its_self_check_refused_it(monkeypatch):
    """On a GPU backend with our products: 32 rows where the product kernel passed its
    self-check (a row-by-row stand-in), 7 (MLX's products' bound) where it was refused (a
    stand-in whose rows alone differ from their place among others)."""
    from mtpcli import kernels, synthetic
    from mtpcli.kernels import quantized_matmul as qm
    from mtpcli.kernels.qmm_kernel import MAX_ROWS
    from mtpcli.options import Options

    def rows(x, w, s, b, *, group_size, bits, **kw):  # each row alone: row-invariant
        flat = x.reshape(-1, x.shape[-1])
        opts = {"group_size": group_size, "bits": bits}
        y = mx.concatenate([qm.quantized_matmul_ops(flat[i : i + 1], w, s, b, **opts)
                            for i in range(flat.shape[0])])  # fmt: skip
        return y.reshape(*x.shape[:-1], -1)

    def by_count(x, w, s, b, **kw):  # rows depend on how many share the launch
        return rows(x, w, s, b, **kw) + (x.size // x.shape[-1] > 1) * 0.5

    for module in (kernels, qm):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    for native, cap in ((rows, MAX_ROWS), (by_count, 7)):
        monkeypatch.setattr(qm, "launch", native)
        kernels.reset_verdicts()
        target, _ = synthetic.build("tiny", bits=4, options=Options(qmm="ours"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the refusal's warning
            assert target.batch_rows == cap


def test_rows_are_capped_where_products_are_not_row_invariant(load, monkeypatch):
    """On a GPU backend: a target whose products are all row-invariant decodes as many rows
    together as its product kernel takes; one with a layer that is not (a dense product, a
    routed layer off our kernels), one row; a batch refuses a row past the cap."""
    import copy

    from mtpcli import kernels
    from mtpcli.kernels.qmm_kernel import MAX_ROWS

    target = copy.copy(load(bits=4).target)
    if kernels.backend() == "cpu":
        assert target.batch_rows is None  # the CPU: any number
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    assert target.batch_rows == (MAX_ROWS if target.options.ours else 7)
    target.unprobed = [True, *target.unprobed[1:]]
    assert target.batch_rows == 1
    batch = Batch(target)
    batch.rows = [object()]  # one row decoding already
    with pytest.raises(BatchNotSupportedError, match="at most 1 requests"):
        batch.add([5, 6], max_tokens=4)


def test_the_server_decodes_no_more_rows_together_than_the_target_allows(load, monkeypatch):
    import copy
    import dataclasses

    from mtpcli.serve import Decoder

    loaded = load(bits=4)
    assert Decoder(loaded, max_batch=8).max_batch == 8  # the CPU: as asked
    target = copy.copy(loaded.target)
    monkeypatch.setattr(type(target), "batch_rows", property(lambda self: 3))
    notes = []
    decoder = Decoder(dataclasses.replace(loaded, target=target), max_batch=8, note=notes.append)
    assert decoder.max_batch == 3 and "at most 3 requests" in notes[0]


def test_a_request_that_starts_as_an_earlier_one_resumes_from_its_snapshot(load):
    """With a prompt cache, a second request whose first message is the first request's
    skips that part, joins the batch beside it and decodes its tokens alone."""
    from mtpcli.engine.prompt_cache import PromptCache

    target = load(bits=4).target
    first, second = [7, 8, 9, 10, 11, 12, 1, 2, 3], [7, 8, 9, 10, 11, 12, 40, 41]
    cache = PromptCache(1 << 30)
    batch = Batch(target)
    batch.add(first, owner=0, max_tokens=12, prompt_cache=cache, boundaries=[6])
    batch.step()
    row = batch.add(second, owner=1, max_tokens=12, prompt_cache=cache, boundaries=[6])
    assert row.stats.prompt_cached == 6
    got = {0: [], 1: []}
    batch.drain(got)
    assert got[1] == _alone(target, second, 12, SamplingParams(), None)


def test_on_the_gpu_path_a_batch_attends_in_one_call_each_row_at_its_own_length(
    load, gpu_paths, monkeypatch
):
    """The GPU's choices on the CPU (``gpu_paths``): a batch's attention layer is one call for
    every row with each row's length, the new keys written at each row's own length
    (``BatchKV.write``), the batch's steps run as one compiled graph once settled, and every
    row decodes what it decodes alone there. Mutation: every row read at the first row's
    length changes the tokens."""
    import conftest

    from mtpcli.models import qwen3_5 as tm

    shared = load(bits=4).target
    target = shared.with_options(shared.options)  # traces of its own, under these paths
    requests = [r for r in REQUESTS if r[2].greedy]
    want = [_alone(target, *r[:4]) for r in requests]
    calls = []

    def counted(q, *args, **kw):
        calls.append(q.shape[0])
        return conftest.rows_length_attention(q, *args, **kw)

    monkeypatch.setattr(tm, "decode_attention_rows", counted)
    got = _batched(target, requests)
    for i, w in enumerate(want):
        assert got[i] == (w if requests[i][5] is None else w[: len(got[i])]), f"request {i}"
    assert max(calls) == len(requests) and (1, False) in target.batch_graph_lengths
    calls.clear()  # the same requests again: every step runs a graph traced above
    assert _batched(target, requests) == got and not calls

    def one_length(q, k, v, gate, q_norm, k_norm, eps, keys, values, lengths, *rest, **kw):
        lengths = mx.broadcast_to(lengths[:1], lengths.shape)
        return conftest.rows_length_attention(q, k, v, gate, q_norm, k_norm, eps, keys, values,
                                              lengths, *rest, **kw)  # fmt: skip

    monkeypatch.setattr(tm, "decode_attention_rows", one_length)
    got = _batched(target.with_options(target.options), requests)
    assert any(got[i] != w[: len(got[i])] for i, w in enumerate(want))
