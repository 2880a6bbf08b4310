"""Batched MTP rounds (``engine/mtp_batch.py``): every greedy row decodes the tokens its request
decodes alone in classic steps (the reference, ``generate_classic``), whatever else shares the
round, joins or leaves, while the rows accept ragged counts; a sampled row decodes what it
decodes alone with its seed. Mutations show the tests can fail: a rollback that keeps one
row's count for every row, one that keeps the whole block, rows reordered after a drop."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtpcli import kernels
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp_batch import MTPBatch
from mtpcli.engine.sampling import SamplingParams
from mtpcli.errors import BatchNotSupportedError, UsageError
from mtpcli.models import qwen3_5 as tm
from mtpcli.models.kv_cache import BatchKV

# (prompt, max_tokens, sampling, seed, round it joins at, round its client leaves at)
REQUESTS = [
    ([5, 9, 13, 200, 7], 24, SamplingParams(), None, 0, None),
    ([250, 2, 2, 2, 2, 2, 2, 11, 12], 20, SamplingParams(temp=1.0), 11, 0, None),
    ([44] * 23, 30, SamplingParams(), None, 2, None),  # joins mid-way, prompt of another length
    ([3], 9, SamplingParams(), None, 3, None),  # a one-token prompt; ends early
    ([17, 18], 40, SamplingParams(), None, 1, 5),  # its client leaves after 5 rounds
]


_ALONE: dict = {}  # (target, request) -> its classic tokens alone


def _alone(target, prompt, n, sampling, seed) -> list[int]:
    key = (id(target), tuple(prompt), n, sampling, seed)
    if key not in _ALONE:
        if seed is not None:
            mx.random.seed(seed)
        _ALONE[key] = list(generate_classic(target, prompt, max_tokens=n, sampling=sampling))
    return _ALONE[key]


def _batched(loaded, requests, block=3, eos=()) -> tuple[dict[int, list[int]], list]:
    batch = MTPBatch(loaded.target, loaded.drafter, block)
    got, rounds, rows = {i: [] for i in range(len(requests))}, 0, []
    pending = sorted(range(len(requests)), key=lambda i: requests[i][4])
    while pending or batch.rows:
        while pending and requests[pending[0]][4] <= rounds:
            i = pending.pop(0)
            prompt, n, sampling, seed, _, _ = requests[i]
            rows.append(batch.add(prompt, owner=i, max_tokens=n, sampling=sampling, seed=seed,
                                  eos_ids=eos))  # fmt: skip
        if batch.rows:
            batch.advance(got)
        rounds += 1
        batch.drop([r for r in batch.rows if requests[r.owner][5] == rounds])  # clients leaving
    return got, rows


def _check(loaded, requests, got) -> None:
    for i, (prompt, n, sampling, seed, _, leaves) in enumerate(requests):
        want = _alone(loaded.target, prompt, n, sampling, seed)
        if leaves is not None:  # the tokens it decoded before its client left
            assert 0 < len(got[i]) < len(want)
            want = want[: len(got[i])]
        assert got[i] == want, f"request {i}"


@pytest.mark.parametrize("moe,bits", [(False, 4), (False, None), (True, 4)],
                         ids=["dense-4bit", "dense-bf16", "moe-4bit"])  # fmt: skip
def test_each_row_decodes_what_its_request_decodes_alone(load, moe, bits, monkeypatch):
    loaded = load(moe=moe, bits=bits)
    if MTPBatch(loaded.target, loaded.drafter, 3).max_rows == 1:  # a GPU without exact rows
        batch = MTPBatch(loaded.target, loaded.drafter, 3)
        batch.add([5, 6], max_tokens=4)
        with pytest.raises(BatchNotSupportedError):
            batch.add([5, 6], max_tokens=4)
        return
    kept, real = [], tm.rollback_rows
    monkeypatch.setattr(tm, "rollback_rows", lambda c, t, n_keep, block, mode: (
        kept.append(list(n_keep)), real(c, t, n_keep, block, mode)))  # fmt: skip
    got, rows = _batched(loaded, REQUESTS)
    _check(loaded, REQUESTS, got)
    # the predictable drafter is right most of the time, not always: ragged rounds
    assert any(len(set(n)) > 1 for n in kept) and any(max(n) == 3 for n in kept)
    assert sum(r.stats.mtp.accepted for r in rows) > 0
    for r in rows:  # a sampled row's steps are classic steps, every step counted
        assert r.stats.mtp.rounds + r.stats.mtp.classic_steps > 0
        assert r.stats.mtp.rounds == 0 if not r.sampling.greedy else r.stats.mtp.rounds > 0


def test_each_rows_drafts_are_its_own(load, monkeypatch):
    """On the CPU (whose products are row-invariant, the drafter's too) each greedy row accepts
    in every round what it accepts decoding alone (a drafter output read at another position
    changes the drafts, not the tokens), and after every step the drafter's cache holds each
    row's positions as the target's does (one a token before the pending one)."""
    from mtpcli.engine.mtp import generate_mtp
    from mtpcli.stats import GenerationStats

    loaded = load(bits=4)
    if kernels.backend() != "cpu":
        pytest.skip("the drafter's rows are row-invariant on the CPU only")
    requests = [r for r in REQUESTS if r[2].greedy and r[5] is None]
    real, steps = MTPBatch.step, []

    def step(self):
        out = real(self)
        target_kv = next(c for c in self.tcache if isinstance(c, BatchKV))
        steps.append((list(self.dcache[0].lengths), list(target_kv.lengths)))
        return out

    monkeypatch.setattr(MTPBatch, "step", step)
    _, rows = _batched(loaded, requests, block=4)
    assert steps and all(drafter == target for drafter, target in steps)
    for (prompt, n, *_), r in zip(requests, rows, strict=True):
        alone = GenerationStats()
        list(generate_mtp(loaded.target, loaded.drafter, prompt, block_size=4, max_tokens=n,
                          stats=alone, build_ahead=False))  # fmt: skip
        assert r.stats.mtp.accept_histogram == alone.mtp.accept_histogram
        assert sum(alone.mtp.accept_histogram[1:]) > 0  # drafts were accepted


def test_random_drafter_rejects_and_rows_stay_exact(load):
    loaded = load(bits=4, drafter="random")
    got, _ = _batched(loaded, REQUESTS[:3], block=4)
    _check(loaded, REQUESTS[:3], got)


def test_a_row_ends_at_eos_mid_round_and_the_others_go_on(load, monkeypatch):
    """An EOS that a round accepts with tokens after it: the row ends there (the tokens after
    it dropped), and the other rows, one sampled, decode on as alone."""
    loaded = load(bits=4)
    alone = _alone(loaded.target, REQUESTS[0][0], 24, SamplingParams(), None)
    real, cut = MTPBatch._emit, []

    def emit(self, r, tokens, lse, k):
        out = real(self, r, tokens, lse, k)
        if r.owner == 0 and out.ended and len(out.tokens) + 1 < len(tokens):
            cut.append(tokens)  # the EOS came before the round's last token
        return out

    monkeypatch.setattr(MTPBatch, "_emit", emit)
    for j in range(2, 12):  # an EOS some round accepts with more after it
        eos = alone[j]
        if eos in alone[:j]:
            continue
        got, _ = _batched(loaded, REQUESTS[:3], eos=(eos,))
        if cut:
            break
    assert cut, "no EOS fell before the end of its round"
    for i in range(3):
        prompt, n, sampling, seed, _, _ = REQUESTS[i]
        want = _alone(loaded.target, prompt, n, sampling, seed)
        assert got[i] == (want[: want.index(eos)] if eos in want else want), f"request {i}"


def test_rollback_rows_mutations_fail(load, monkeypatch):
    """A rollback that keeps the first row's count for every row, or the whole block, or rows
    reordered after one leaves, changes some request's tokens."""
    loaded = load(bits=4)
    real_rollback, real_keep = tm.rollback_rows, BatchKV.keep

    def first_rows_count(cache, traces, n_keep, block, mode):
        real_rollback(cache, traces, [n_keep[0]] * len(n_keep), block, mode)

    def keep_all(cache, traces, n_keep, block, mode):
        real_rollback(cache, traces, [block] * len(n_keep), block, mode)

    def reversed_keep(self, rows):
        return real_keep(self, rows[::-1])

    for name, obj, fn in [("rollback_rows", tm, first_rows_count), ("rollback_rows", tm, keep_all),
                          ("keep", BatchKV, reversed_keep)]:  # fmt: skip
        with monkeypatch.context() as m:
            m.setattr(obj, name, fn)
            got, _ = _batched(loaded, REQUESTS)
        with pytest.raises(AssertionError):
            _check(loaded, REQUESTS, got)


def test_past_round_rows_the_batch_decodes_one_token_a_row_and_stays_exact(load):
    """Rounds while rows x block fit ``round_rows``: the third request turns the rounds into
    steps of one position (the drafter kept current), the first to leave turns them back."""
    loaded = load(bits=4)
    requests = [([5, 9, 13, 200, 7], 10, SamplingParams(), None, 0, None),
                ([17, 18], 30, SamplingParams(), None, 0, None),
                ([44] * 23, 30, SamplingParams(), None, 2, None)]  # fmt: skip
    batch = MTPBatch(loaded.target, loaded.drafter, 3, round_rows=6)
    got, rows, kinds = {i: [] for i in range(3)}, [], []
    for rnd in range(60):
        for i, (prompt, n, *_rest) in enumerate(requests):
            if _rest[2] == rnd:
                rows.append(batch.add(prompt, owner=i, max_tokens=n))
        if not batch.rows:
            break
        kinds.append(batch.rounds())
        batch.advance(got)
    _check(loaded, requests, got)
    assert kinds[:2] == [True, True] and False in kinds and kinds[-1] is True
    assert all(r.stats.mtp.classic_steps > 0 and r.stats.mtp.rounds > 0 for r in rows[1:])


def test_rows_are_capped_by_exact_product_rows(load, monkeypatch):
    loaded = load(bits=4)
    monkeypatch.setattr(type(loaded.target), "batch_rows", property(lambda self: 7))
    batch = MTPBatch(loaded.target, loaded.drafter, 3, round_rows=100)
    assert batch.max_rows == 2
    assert MTPBatch(loaded.target, loaded.drafter, 3, round_rows=6).max_rows == 7
    batch.add([5, 6], max_tokens=4)
    batch.add([5, 7], max_tokens=4)
    with pytest.raises(BatchNotSupportedError, match="at most 2 requests"):
        batch.add([5, 8], max_tokens=4)
    with pytest.raises(UsageError, match="block_size"):
        MTPBatch(loaded.target, loaded.drafter, 1)


def test_rows_resumed_from_the_prompt_cache_decode_as_cold_ones(load, monkeypatch):
    """A request that starts as an earlier one did joins from its snapshot (the drafter's part
    included, left by a row of a batch) with the tokens of a cold start, beside a cold row."""
    from mtpcli.engine.prompt_cache import PromptCache

    monkeypatch.setattr(tm, "PREFILL_CHUNK", 16)
    loaded = load(bits=4)
    first = [5, 9, 13, 200, 7] * 12 + [3, 4]  # 62 tokens: a cut at 48 and at its end
    nxt = first + [11, 12, 13]
    cache = PromptCache(1 << 30)
    batch, got = MTPBatch(loaded.target, loaded.drafter, 3), {0: [], 1: [], 2: []}
    batch.add(first, owner=0, max_tokens=12, prompt_cache=cache)
    batch.drain(got)
    rows = [batch.add(nxt, owner=1, max_tokens=16, prompt_cache=cache),
            batch.add([44] * 9, owner=2, max_tokens=16, prompt_cache=cache)]  # fmt: skip
    batch.drain(got)
    assert rows[0].stats.prompt_cached == 48 and rows[1].stats.prompt_cached == 0
    for i, (prompt, n) in enumerate([(first, 12), (nxt, 16), ([44] * 9, 16)]):
        assert got[i] == _alone(loaded.target, prompt, n, SamplingParams(), None), f"request {i}"
