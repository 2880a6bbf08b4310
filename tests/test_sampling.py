"""Temperature > 0: speculative sampling keeps the target's distribution."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import pytest

from mtpcli.engine import sampling
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp
from mtpcli.engine.sampling import SamplingParams, accept_greedy, accept_sampled, probs


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _one_sample_chi2(counts: Counter, expected: list[float], n: int) -> tuple[float, int]:
    stat = sum((counts.get(i, 0) - n * e) ** 2 / (n * e) for i, e in enumerate(expected) if e > 0)
    return stat, sum(1 for e in expected if e > 0) - 1


def _two_sample_chi2(a: Counter, b: Counter) -> tuple[float, int]:
    cells = set(a) | set(b)
    stat = sum((a.get(c, 0) - b.get(c, 0)) ** 2 / (a.get(c, 0) + b.get(c, 0)) for c in cells)
    return stat, len(cells) - 1


def test_accept_greedy_is_the_longest_matching_prefix():
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accept_greedy([1, 9, 3], [1, 2, 3, 4]) == 1
    assert accept_greedy([9], [1, 2]) == 0
    assert accept_greedy([], [5]) == 0


def _first_token_counts(n: int) -> tuple[Counter, list[float]]:
    mx.random.seed(0)
    p = mx.array([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03], [0.2] * 5 + [0.0]])  # [k+1, V]
    q = mx.array([[0.05, 0.05, 0.30, 0.30, 0.20, 0.10]])  # [k, V]
    counts = Counter()
    for _ in range(n):
        d = int(mx.random.categorical(mx.log(q[0])).item())
        accepted, token = accept_sampled(p, q, mx.array([d]))
        counts[d if accepted else token] += 1
    return counts, p[0].tolist()


def test_accept_sampled_preserves_the_target_distribution():
    n = 3000
    counts, expected = _first_token_counts(n)
    stat, df = _one_sample_chi2(counts, expected, n)
    assert stat < _chi2_critical(df), (stat, counts)


def test_a_wrong_residual_is_caught(monkeypatch):
    """Mutation: resampling a rejection from p instead of the residual must fail the test above."""
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    n = 3000
    counts, expected = _first_token_counts(n)
    stat, df = _one_sample_chi2(counts, expected, n)
    assert stat > _chi2_critical(df)


def test_filters_apply_to_the_distribution():
    logits = mx.array([4.0, 3.0, 2.0, 1.0, 0.0])
    top2 = probs(logits, SamplingParams(temp=1.0, top_k=2)).tolist()
    assert top2[2:] == [0.0, 0.0, 0.0] and abs(sum(top2) - 1) < 1e-6
    nucleus = probs(logits, SamplingParams(temp=1.0, top_p=0.5)).tolist()
    assert nucleus[0] > 0 and nucleus[-1] == 0.0
    minp = probs(logits, SamplingParams(temp=1.0, min_p=0.3)).tolist()
    assert sum(1 for x in minp if x > 0) == 2


def _joint_first_tokens(load, block: int | None, n: int = 400) -> Counter:
    # A softened predictable head: target and drafter distributions overlap but differ, so
    # drafts are both accepted and rejected (and a rejection's residual matters).
    loaded = load(head_scale=0.03)
    s = SamplingParams(temp=1.0, top_k=3)
    prompt = [72, 101, 108]
    mx.random.seed(1 if block is None else 2)
    if block is None:
        runs = (generate_classic(loaded.target, prompt, max_tokens=3, sampling=s) for _ in range(n))
    else:
        runs = (
            generate_mtp(
                loaded.target, loaded.drafter, prompt, block_size=block, max_tokens=3, sampling=s
            )  # fmt: skip
            for _ in range(n)
        )
    return Counter(tuple(r) for r in runs)


@pytest.fixture(scope="module")
def classic_joint(load):
    return _joint_first_tokens(load, None)


@pytest.mark.parametrize("block", [2, 3])
def test_mtp_sampling_matches_classic_sampling(load, classic_joint, block):
    """The first three tokens' joint distribution under MTP equals classic sampling."""
    assert len(classic_joint) > 5  # the test has something to compare
    stat, df = _two_sample_chi2(classic_joint, _joint_first_tokens(load, block))
    assert stat < _chi2_critical(df), (stat, df)


def test_a_wrong_residual_is_caught_end_to_end(load, classic_joint, monkeypatch):
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    stat, df = _two_sample_chi2(classic_joint, _joint_first_tokens(load, 2))
    assert stat > _chi2_critical(df), (stat, df)


def test_seed_makes_sampling_reproducible(load):
    loaded = load()
    s = SamplingParams(temp=0.8, top_p=0.9)

    def run(seed):
        mx.random.seed(seed)
        return list(generate_mtp(loaded.target, loaded.drafter, [5, 6, 7], block_size=3,
                                 max_tokens=24, sampling=s))  # fmt: skip

    assert run(3) == run(3)


def test_a_step_is_read_back_in_one_array_built_before_it_is_submitted():
    """The decode loop reads a step's token and logsumexp as one array made with the step
    (an operation on the logsumexp made after the next step was queued, a reshape to read it,
    waited for that step: a 27B classic decode on the H100 fell from 110 to 80 tok/s); and a
    non-finite one stops the generation."""
    ids, lse = mx.array([7], mx.uint32), mx.array([1.5], mx.bfloat16)
    assert sampling.readback(ids, lse).tolist() == [7.0, 1.5]
    assert sampling.readback(mx.array([248319], mx.uint32), lse).tolist()[0] == 248319
    sampling.check_finite([1.0, 2.0], 0)
    with pytest.raises(sampling.NonFiniteOutputError, match="generated token 3"):
        sampling.check_finite([1.0, float("nan")], 3)


@pytest.mark.parametrize("kw,param", [
    ({"temp": -1.0}, "temp"), ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
])  # fmt: skip
def test_a_sampling_error_names_its_input_by_the_api_name(kw, param):
    """Checked once, in SamplingParams; the message names no flag or field (the CLI puts its
    flag before it, the server its field), and ``str()`` reads with the API name."""
    with pytest.raises(sampling.SamplingError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and "--" not in e.value.message
    assert str(e.value).startswith(f"{param} must")
