"""Sampling: one processed distribution for target and drafter, and the speculative accept."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..errors import NonFiniteOutputError, SamplingError

# Outside these the float32 distribution is numerically greedy or uniform, and at the edges
# (subnormal or infinite temperatures) NaN: ask for 0 (greedy) instead of sampling garbage.
MIN_TEMP, MAX_TEMP = 1e-6, 1e6


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        # Checked here once for every caller; each front end names the input its own way.
        if not (self.temp == 0 or MIN_TEMP <= self.temp <= MAX_TEMP):
            raise SamplingError(
                f"must be 0 (greedy) or in [{MIN_TEMP:g}, {MAX_TEMP:g}], got {self.temp!r}",
                param="temp",
            )
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.top_k < 0:
            raise SamplingError(f"must be >= 0, got {self.top_k!r}", param="top_k")
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"must be in [0, 1], got {self.min_p!r}", param="min_p")

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def positions(logits: mx.array) -> mx.array:
    """[1, T, V] -> [T, V], a view. A lone integer index (``logits[0]``) is a ``take`` in MLX,
    which copies through a gather kernel (``logits[0, -1]``, a tuple, is a view)."""
    return logits.reshape(logits.shape[1:])


def probs(logits: mx.array, s: SamplingParams) -> mx.array:
    """The sampling distribution [..., V] (float32) after top-p / min-p / top-k and temperature.

    The target and the drafter go through this same function, so speculative sampling
    compares like with like.
    """
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if s.top_p < 1.0:
        logprobs = apply_top_p(logprobs, s.top_p)
    if s.min_p > 0.0:
        logprobs = apply_min_p(logprobs, s.min_p)
    if 0 < s.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, s.top_k)
    return mx.softmax(logprobs / s.temp, axis=-1)


def greedy(logits: mx.array) -> mx.array:
    """Argmax per row of logits [..., V], taken over log-probabilities in the logits' dtype.

    This is mlx-lm's greedy rule: in bf16 the subtraction can tie two logits, and the tie then
    goes to the lower id; matching it keeps our tokens equal to mlx-lm's.
    """
    return greedy_checked(logits)[0]


def greedy_checked(logits: mx.array) -> tuple[mx.array, mx.array]:
    """``greedy``'s ids [...] and the logsumexp it normalises by [..., 1], which is finite
    exactly when no logit of the row is NaN or +Inf (``check_finite`` reads it)."""
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logits - lse, axis=-1), lse


def pick(logits: mx.array, s: SamplingParams) -> mx.array:
    """One token id per row of logits [..., V]: greedy at temperature 0, else a sample."""
    return pick_checked(logits, s)[0]


def pick_checked(logits: mx.array, s: SamplingParams,
                 key: mx.array | None = None) -> tuple[mx.array, mx.array]:  # fmt: skip
    """``pick`` and the logits' logsumexp [..., 1] for ``check_finite`` (at temperature 0 the
    one greedy takes anyway, so the check adds no launch there). A sample draws with ``key``
    where given, else from MLX's global key sequence."""
    if s.greedy:
        return greedy_checked(logits)
    return (mx.random.categorical(mx.log(probs(logits, s)), key=key),
            mx.logsumexp(logits, axis=-1, keepdims=True))  # fmt: skip


class KeyChain:
    """A request's own random keys, drawn in the order MLX's global sequence would give them
    after ``mx.random.seed(seed)``: a request sampled in a batch draws what it draws alone."""

    def __init__(self, seed: int) -> None:
        self.key = mx.random.key(seed)

    def next(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub


def readback(ids: mx.array, lse: mx.array) -> mx.array:
    """What the host reads of a step: its token ids then their logsumexps, one float32 array
    [2 n] (ids below 2^24 are exact in float32), built into the step before it is submitted,
    so that one read brings both: an operation made after the next step was queued (a reshape
    of the logsumexp to read it) would wait for that step."""
    return mx.concatenate([ids.astype(mx.float32).reshape(-1), lse.astype(mx.float32).reshape(-1)])


def check_finite(lse: Sequence[float], position: int) -> None:
    """Stop on a NaN or +Inf logit (``lse``: logsumexps already read back, see ``readback``):
    decoding past one prints garbage with a clean exit. ``position`` counts generated tokens."""
    if not all(math.isfinite(v) for v in lse):
        raise NonFiniteOutputError(
            f"the target's logits at generated token {position} are not finite (NaN or Inf): "
            "its weights are damaged or were converted wrongly (an embedding row, a norm); "
            "re-download or re-convert the checkpoint"
        )


def accept_greedy(drafts: list[int], targets: list[int]) -> int:
    """The number of leading drafts that equal the target's own next tokens."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def greedy_verdict(logits: mx.array, drafts: mx.array) -> mx.array:
    """A round's verdict as the host reads it, in one wait: the target's tokens at the k+1
    verified positions, the k drafts, the positions' k+1 logsumexps (for ``check_finite``),
    float32 [3k+2]."""
    return _verdict(*greedy_checked(logits), drafts)


def _verdict(tokens: mx.array, lse: mx.array, drafts: mx.array) -> mx.array:
    return readback(mx.concatenate([tokens, drafts.astype(mx.uint32)]), lse)


def accept_on_device(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """A temperature-0 round decided on the device, nothing read: the verdict for
    ``read_verdict`` later, the target's tokens [k+1] (the accepted drafts, then the next
    token, then the rest) and the positions kept, accepted drafts + 1 (int32 [1])."""
    tokens, lse = greedy_checked(logits)  # [k+1], [k+1, 1]
    agree = (tokens[:-1] == drafts.astype(tokens.dtype)).astype(mx.int32)  # [k]
    n_keep = 1 + mx.cumprod(agree).sum(keepdims=True)  # [1]
    return _verdict(tokens, lse, drafts), tokens, n_keep.astype(mx.int32)


def read_verdict(verdict: mx.array, k: int, position: int) -> tuple[int, list[int]]:
    """Read a greedy verdict (``greedy_verdict``): the accepted drafts n and the target's
    tokens at the k+1 positions, whose first n + 1 are emitted and so checked finite
    (``position``: tokens generated before)."""
    values = verdict.tolist()
    ids, lse = [int(v) for v in values[: 2 * k + 1]], values[2 * k + 1 :]
    n = accept_greedy(ids[k + 1 :], ids[: k + 1])
    check_finite(lse[: n + 1], position)
    return n, ids[: k + 1]


def accept(
    logits: mx.array, drafts: mx.array, q: mx.array | None, s: SamplingParams, position: int = 0
) -> tuple[int, int]:
    """One round's verdict from the target logits [k+1, V] and the drafts [k] (token ids):
    (accepted drafts, next token). The positions whose tokens are emitted must have finite
    logits, as classic decoding checks them (``position``: tokens generated before)."""
    if s.greedy:
        n, ids = read_verdict(greedy_verdict(logits, drafts), drafts.shape[0], position)
        return n, ids[n]
    lse = mx.logsumexp(logits, axis=-1).astype(mx.float32).tolist()  # the round is read
    out = accept_sampled(probs(logits, s), q, drafts)
    check_finite(lse[: out[0] + 1], position)
    return out


def accept_sampled(p: mx.array, q: mx.array, drafts: mx.array) -> tuple[int, int]:
    """Speculative sampling for one round; preserves the target distribution.

    p: [k+1, V] target distributions at the verified positions; q: [k, V] the drafter's
    distributions the drafts were sampled from. Draft i is accepted with probability
    min(1, p_i(d)/q_i(d)); the first rejected position is resampled from the normalised
    residual max(0, p_i - q_i); if every draft is accepted, a bonus token is drawn from p_k.
    Returns (accepted count, the target token that ends the round).
    """
    k = drafts.shape[0]
    rows, d = mx.arange(k), drafts
    pd, qd = p[rows, d], q[rows, d]
    u = mx.random.uniform(shape=(k,))
    ok = (u * qd < pd).tolist()
    n = next((i for i, a in enumerate(ok) if not a), k)
    dist = p[k] if n == k else residual(p[n], q[n])
    return n, int(mx.random.categorical(mx.log(dist)).item())


def residual(p: mx.array, q: mx.array) -> mx.array:
    """norm(max(0, p - q)) [V]: where a rejected position is resampled from (p if p == q)."""
    r = mx.maximum(p - q, 0.0)
    total = r.sum()
    return mx.where(total > 0, r / mx.maximum(total, 1e-30), p)
