"""The gate: engage MTP only where it is expected to beat classic decoding on this machine.

A round at block size b drafts k = b - 1 tokens and verifies b positions. With a per-draft
acceptance a (a draft counts only after all before it were accepted) a round emits
``E = 1 + a + ... + a^k`` tokens on average. A round costs ``round_ms[b]`` and a classic step
``step_ms`` per token, both timed as the engines run them (so pipelining, the drafter's
catch-up, the rollback and Python overhead are all in). The expected speedup is
``E * step_ms / round_ms[b]``; MTP engages when it is at least ``MARGIN``.

Both costs grow with the context (a step's attention reads every attention layer's KV cache,
a round's verify does for each of its positions and the drafter's chain for each draft), so
they are timed at a few context lengths and interpolated between them: the gate decides at the
prompt's length, and the round-by-round choice (``BlockChooser``) at the length reached,
switching MTP off where no round pays any more.

The costs come from a calibration measured once per machine and model shape (a few short
generations at each context length) and cached in ``cache_dir()/gate.json``; the acceptance
from the last run of the same target and drafter (before there is one, the acceptance seen in
the calibration's own MTP runs when it has just calibrated, else ``PRIOR_ACCEPTANCE``; the
model takes a to be the same at every draft position, so it carries over between block sizes).
When no block size was asked for, the gate also picks the block size with the best expected
speedup.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import platform
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx

from . import kernels
from .config import BLOCK_MAX, BLOCK_MIN
from .errors import MtpError
from .files import read_bounded
from .options import Options
from .stats import GenerationStats, MTPStats

PRIOR_ACCEPTANCE = 0.6
# Predictions came within about 5% of the measured speedups on the CPU example
# (docs/benchmark_results/cpu_example_bench_9e23fa2.md): ask for at least that much expected gain.
MARGIN = 1.05
# Running MTP, a round stops being chosen only once it is expected to lose (below 1.0x), so
# that costs near the margin do not switch it off and on round after round.
KEEP_ABOVE = 1.0
STORE_VERSION = 4
SHORT = 16  # the made-up prompt's length: the shortest context timed
# Context lengths timed (those the model has room for): the costs between are interpolated,
# those past the longest extrapolated along the last two points.
CONTEXTS = (SHORT, 4096, 16384, 65536)
MAX_CONTEXT = 10**7


@dataclass(frozen=True)
class Costs:
    """Measured costs at one context length, ms: a classic step (per token, pipelined as it
    runs) and a whole MTP round (draft, verify, accept, roll back, emit) by block size."""

    step_ms: float
    round_ms: dict[int, float]


@dataclass(frozen=True)
class Calibration:
    """Costs by context length (tokens in the cache when decoding), at least one."""

    costs: dict[int, Costs]
    # per-draft acceptance seen in the timed MTP runs (of this pair; not kept with the costs)
    acceptance: float | None = None

    @classmethod
    def constant(cls, step_ms: float, round_ms: dict[int, float],
                 acceptance: float | None = None) -> Calibration:  # fmt: skip
        """The same costs at every context length."""
        return cls({SHORT: Costs(step_ms, round_ms)}, acceptance)

    def at(self, context: int) -> Costs:
        """The costs at ``context`` tokens: linear between the two timed lengths around it
        (attention's share grows linearly with the cache), along the last two past the longest
        (never decreasing), the shortest's below it."""
        points = sorted(self.costs)
        blocks = set.intersection(*(set(c.round_ms) for c in self.costs.values()))
        if context <= points[0] or len(points) == 1:
            return self.costs[points[0]]
        hi = next((p for p in points if p >= context), points[-1])
        lo = points[points.index(hi) - 1]
        f = (context - lo) / (hi - lo)

        def line(a: float, b: float) -> float:
            return b + (f - 1) * max(b - a, 0.0) if context > hi else a + f * (b - a)

        a, b = self.costs[lo], self.costs[hi]
        return Costs(line(a.step_ms, b.step_ms),
                     {k: line(a.round_ms[k], b.round_ms[k]) for k in sorted(blocks)})  # fmt: skip

    @property
    def contexts(self) -> list[int]:
        return sorted(self.costs)


@dataclass(frozen=True)
class GateDecision:
    engaged: bool
    block: int  # the block size to run (chosen among the candidates when adapting)
    reason: str  # names the acceptance used and where it came from
    expected_speedup: float | None  # None when forced
    # where the gate chose the block: it may change it round by round as acceptance is seen
    chooser: BlockChooser | None = None
    # where rounds are expected to pay only once the context has grown: from about here
    starts_at: int | None = None


def tokens_per_round(acceptance: float, drafts: int) -> float:
    """Expected tokens a round emits: the accepted prefix of ``drafts`` drafts, plus one."""
    return sum(acceptance**i for i in range(drafts + 1))


def expected_speedup(cal: Calibration, block: int, acceptance: float, context: int = 0) -> float:
    """A round's expected tokens over its cost in classic steps, at ``context`` tokens."""
    costs = cal.at(context)
    return tokens_per_round(acceptance, block - 1) * costs.step_ms / costs.round_ms[block]


def decide(cal: Calibration, blocks: list[int], acceptance: float, source: str,
           context: int = 0) -> GateDecision:  # fmt: skip
    """The best of ``blocks`` by expected speedup at ``context`` tokens, engaged if that clears
    ``MARGIN``."""
    costs = cal.at(context)
    speedups = {b: expected_speedup(cal, b, acceptance, context) for b in blocks}
    block = max(blocks, key=lambda b: (speedups[b], -b))  # ties: the smaller block
    speedup = speedups[block]
    engaged = speedup >= MARGIN
    others = ", ".join(f"{b}: {v:.2f}x" for b, v in speedups.items() if b != block)
    reason = (
        f"expected {speedup:.2f}x classic at block {block} with acceptance {acceptance:.2f} "
        f"({source}): at {context} tokens of context a classic step costs "
        f"{costs.step_ms:.2f} ms, a round of {block - 1} draft{'s' if block > 2 else ''} and a "
        f"verify {costs.round_ms[block]:.2f} ms"
        + (f" (other blocks {others})" if others else "")
        + "; "
        + ("MTP engaged" if engaged else f"below {MARGIN:.2f}x, decoding classically")
    )
    return GateDecision(engaged, block, reason, speedup)


def first_paying(cal: Calibration, blocks: list[int], acceptance: float, start: int,
                 end: int) -> int | None:  # fmt: skip
    """The first context in (start, end] where a round of one of ``blocks`` is expected to clear
    ``MARGIN``, or None. Between timed lengths a block's expected speedup, a ratio of two costs
    linear in the context, is monotone: each stretch is settled at its ends, then bisected."""

    def pays(context: int) -> bool:
        return max(expected_speedup(cal, b, acceptance, context) for b in blocks) >= MARGIN

    edges = sorted({start, end} | {p for p in cal.contexts if start < p < end})
    for lo, hi in itertools.pairwise(edges):
        if pays(hi):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if pays(mid) else (mid, hi)
            return hi
    return None


def acceptance_estimate(stats: MTPStats) -> float | None:
    """The per-draft acceptance a of a run (maximum likelihood for the truncated chain)."""
    return stats.accepted / stats.examined if stats.examined else None


@dataclass(frozen=True)
class BlockChooser:
    """Each round's block size, from the acceptance seen so far in the generation and the
    context reached: the acceptance the gate decided with counts as ``weight`` examined
    drafts, the run's own drafts as themselves; the block with the best expected speedup
    under ``cal`` at that context wins, or 1 (a classic step) where none is expected to pay:
    below ``KEEP_ABOVE`` while MTP runs, below ``MARGIN`` to switch it back on."""

    cal: Calibration
    blocks: tuple[int, ...]
    prior: float
    weight: float = 8.0
    starts_on: bool = True  # whether rounds run before the first switch

    def __call__(self, stats: MTPStats, context: int) -> int:
        a = (self.prior * self.weight + stats.accepted) / (self.weight + stats.examined)
        speedups = {b: expected_speedup(self.cal, b, a, context) for b in self.blocks}
        block = max(self.blocks, key=lambda b: (speedups[b], -b))
        on = stats.switches[-1][1] if stats.switches else self.starts_on
        return block if speedups[block] >= (KEEP_ABOVE if on else MARGIN) else 1


def machine_key(options: Options) -> str:
    """What the costs depend on besides the model: host, device, MLX, kernel choices."""
    try:
        device = mx.device_info().get("device_name", "")
    except (AttributeError, RuntimeError):
        device = ""
    return "|".join([platform.node(), platform.machine(), kernels.backend(), str(device),
                     mx.__version__, options.kernels,
                     "ours" if options.ours else "mlx"])  # fmt: skip


def shape_key(target, drafter) -> str:
    t = target.config.text
    q = target.config.quantization or {}
    return "|".join(str(v) for v in (
        target.config.model_type, t.hidden_size, t.num_hidden_layers, t.intermediate_size,
        t.vocab_size, t.linear_num_value_heads, t.num_attention_heads, t.num_experts, q.get("bits"),
        q.get("group_size"), (drafter.config.quantization or {}).get("bits"),
    ))  # fmt: skip


# A generation the calibration times: given the statistics to fill, the tokens as they come.
Run = Callable[[GenerationStats], Iterator[int]]


@dataclass(frozen=True)
class Arms:
    """What the gate times: classic decoding, and MTP at a block size, each after a prompt of
    a given length (short generations, as the engines run them; ``generation.gate_arms``
    builds them)."""

    classic: Callable[[int], Run]  # context -> run
    mtp: Callable[[int, int], Run]  # block, context -> run


def calibration_contexts(limit: int, end: int | None = None, tokens: int = 32) -> tuple[int, ...]:
    """The ``CONTEXTS`` a model of ``limit`` positions has room for (a prompt, ``tokens``
    generated and a round's block; half its room where only the shortest fits), and of those,
    with ``end`` (the context a generation ends at), the shortest and those it comes within a
    quarter of: nearer the shortest, a step's and a round's attention is a small share of their
    cost, and each length timed costs prefills of that length."""
    room = limit - tokens - BLOCK_MAX
    fits = tuple(c for c in CONTEXTS if c <= room) or (SHORT,)
    if len(fits) == 1 and room // 2 > 4 * SHORT:
        fits += (room // 2,)
    return tuple(c for i, c in enumerate(fits) if i == 0 or end is None or end >= c // 4)


def calibrate(
    runs: Arms,
    blocks: list[int],
    contexts: tuple[int, ...] = (SHORT,),
    repeats: int = 5,
    budget_s: float = 2.0,
    long_repeats: int = 2,
) -> Calibration:
    """Time classic decoding and MTP rounds of each block size, as they run, after a prompt
    of each of ``contexts`` tokens.

    Each is run once to warm up; then rounds of one run of each, alternating, so that a change
    in the machine's speed (clocks, other load) reaches both sides alike, up to ``repeats``
    rounds, stopping early once the measured rounds took ``budget_s`` per side (a large model
    is timed fewer times: its runs are long and steadier). Past the first context each side
    runs ``long_repeats`` times, alternating (each run prefills its long prompt again). The
    fastest run of each is kept: other load only ever slows a run down.
    """
    seen = [0, 0]  # accepted, examined drafts over the MTP runs

    def measured(run: Run) -> float:
        mx.clear_cache()  # as a fresh process starts; what ran before (a peer) is not carried
        stats = GenerationStats()
        list(run(stats))
        units = stats.mtp.rounds if stats.mtp else stats.generation_tokens
        if stats.mtp:
            seen[0] += stats.mtp.accepted
            seen[1] += stats.mtp.examined
        return stats.generation_s * 1000 / max(units, 1)

    costs = {}
    for i, context in enumerate(contexts):
        # 0: the classic step
        arms = {0: runs.classic(context)} | {b: runs.mtp(b, context) for b in blocks}
        if i == 0:
            for run in arms.values():
                list(run(GenerationStats()))  # warm-up: kernel compilation, caches
        vals: dict[int, list[float]] = {key: [] for key in arms}
        start = time.perf_counter()
        while len(vals[0]) < (repeats if i == 0 else long_repeats) and (
            i > 0 or not vals[0] or time.perf_counter() - start < budget_s * len(arms)
        ):
            for key, run in arms.items():
                vals[key].append(measured(run))
        costs[context] = Costs(min(vals[0]), {b: min(vals[b]) for b in blocks})
    return Calibration(costs, seen[0] / seen[1] if seen[1] else None)


MAX_MS = 1e5  # a step or round of 100 s is no measurement of a model we run
MIN_MS = 1e-3  # nor one of a microsecond: a launch alone costs more
LOCK_WAIT_S = 10.0  # how long a write waits for another run's lock before giving up
MAX_STORE_BYTES = 4 << 20


def _ms(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and MIN_MS <= v <= MAX_MS


def _valid_calibration(c) -> bool:
    costs = c.get("costs") if isinstance(c, dict) else None
    return (
        isinstance(costs, dict)
        and bool(costs)
        and all(_valid_count(k, 1, MAX_CONTEXT) and _valid_costs(v) for k, v in costs.items())
    )


def _valid_count(key, lo: int, hi: int) -> bool:
    # ASCII digits only: "²".isdigit() is true, and int() refuses it
    return isinstance(key, str) and key.isascii() and key.isdigit() and lo <= int(key) <= hi


def _valid_costs(c) -> bool:
    if not isinstance(c, dict):
        return False
    rounds = c.get("round_ms")
    return (
        _ms(c.get("step_ms"))
        and isinstance(rounds, dict)
        and bool(rounds)
        and all(_valid_count(b, BLOCK_MIN, BLOCK_MAX) and _ms(v) for b, v in rounds.items())
    )


def _valid_acceptance(a) -> bool:
    v = a.get("value") if isinstance(a, dict) else None
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and 0 <= v <= 1  # NaN fails this too
        and isinstance(a.get("source"), str)
    )


def _empty() -> dict:
    return {"version": STORE_VERSION, "calibrations": {}, "acceptance": {}}


class GateStore:
    """Calibrations and last acceptances, in one small JSON file.

    It is a cache, and never trusted: what is read is validated entry by entry (an invalid
    entry is dropped, so that pair or shape is measured again) and each problem is kept in
    ``notes``. Writes re-read the file under a lock and replace it atomically, so concurrent
    runs merge their entries instead of losing one."""

    def __init__(self, path: Path):
        self.path = path
        self.notes: list[str] = []
        self.data = self._read()

    def _note(self, what: str) -> None:
        self.notes.append(f"gate cache {self.path}: {what}")

    def _read(self) -> dict:
        if not (self.path.exists() or self.path.is_symlink()):
            return _empty()
        try:
            data = json.loads(read_bounded(self.path, "gate cache", MAX_STORE_BYTES))
        except (MtpError, ValueError, RecursionError) as e:
            self._note(f"unreadable ({e}); measuring afresh")
            return _empty()
        if not isinstance(data, dict) or data.get("version") != STORE_VERSION:
            self._note("not this version's format; measuring afresh")
            return _empty()
        out = _empty()
        for part, valid in (("calibrations", _valid_calibration),
                            ("acceptance", _valid_acceptance)):  # fmt: skip
            entries = data.get(part)
            entries = entries if isinstance(entries, dict) else {}
            bad = [k for k, v in entries.items() if not valid(v)]
            if bad or not isinstance(data.get(part), dict):
                self._note(f"dropped {len(bad) or 'all'} invalid {part} entries")
            out[part] = {k: v for k, v in entries.items() if k not in bad}
        return out

    def calibration(self, key: str, blocks: list[int]) -> Calibration | None:
        """The costs kept for ``key`` at every context length where they hold all ``blocks``
        (None where there is none)."""
        c = self.data["calibrations"].get(key)
        costs = {int(n): Costs(v["step_ms"], {int(b): ms for b, ms in v["round_ms"].items()})
                 for n, v in (c or {}).get("costs", {}).items()}  # fmt: skip
        full = {n: v for n, v in costs.items() if all(b in v.round_ms for b in blocks)}
        return Calibration(full) if full else None

    def put_calibration(self, key: str, cal: Calibration) -> None:
        def put(data: dict) -> None:
            kept = data["calibrations"].get(key, {}).get("costs", {})
            for n, c in cal.costs.items():
                rounds = kept.get(str(n), {}).get("round_ms", {})
                kept[str(n)] = {
                    "step_ms": c.step_ms,
                    "round_ms": rounds | {str(b): v for b, v in c.round_ms.items()},
                }
            data["calibrations"][key] = {"costs": kept}

        self._update(put)

    def acceptance(self, pair: str) -> tuple[float, str] | None:
        """The pair's last known per-draft acceptance and where it came from."""
        entry = self.data["acceptance"].get(pair)
        return (entry["value"], entry["source"]) if entry else None

    def put_acceptance(self, pair: str, value: float, source: str = "last run") -> None:
        entry = {"value": value, "source": source}
        self._update(lambda data: data["acceptance"].update({pair: entry}))

    def _update(self, change: Callable[[dict], None]) -> None:
        """Apply ``change`` to the file's current contents, under the lock, atomically."""
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path.with_name(self.path.name + ".lock")):
                self.data = self._read()  # what other runs wrote since we read it
                change(self.data)
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".gate-")
                with os.fdopen(fd, "w") as f:
                    json.dump(self.data, f, indent=1)
                os.replace(tmp, self.path)
                tmp = None
        except (OSError, LockError) as e:
            change(self.data)  # this run still uses it; the next one measures again
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            self._note(f"not written ({why}); the next run measures again")
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


class LockError(Exception):
    """The cache's lock file could not be taken (it is no regular file, or another run held it
    past ``LOCK_WAIT_S``)."""


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``path`` (a regular file, made if absent). Opened without
    blocking, so a FIFO there cannot hang the run, and waited for at most ``LOCK_WAIT_S``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LockError(f"its lock {path} is not a regular file")
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockError(f"its lock {path} was held for over {LOCK_WAIT_S:g} s") \
                        from None  # fmt: skip
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def store() -> GateStore:
    from .example import cache_dir

    return GateStore(cache_dir() / "gate.json")


ADAPT_BLOCKS = (2, 3, 4)  # block sizes the gate may choose among when none was asked for


def gate(
    target,
    drafter,
    block: int,
    pair: str,
    runs: Arms,
    *,
    context: int = 0,
    max_tokens: int = 0,
    forced: bool = False,
    adapt: bool = False,
    note: Callable[[str], None] = lambda msg: None,
) -> GateDecision:
    """Decide whether this run should use MTP, and at which block size.

    ``runs`` are what a calibration times (where this machine and shape have none cached at
    the context lengths the generation reaches); ``context`` is the prompt's length,
    ``max_tokens`` how far it may grow; ``forced`` (``--draft-kind mtp``) runs MTP at
    ``block``, whatever the context; ``adapt`` (no block size asked for) lets the gate pick
    among ``ADAPT_BLOCKS`` and ``block``; ``note`` is told before a calibration (a few short
    generations at each context length) and of any problem with the cache. Unless forced, the
    decision carries a ``BlockChooser`` that follows the context (and, adapting, the
    acceptance) round by round.
    """
    if forced:
        return GateDecision(True, block, "forced: MTP runs whatever the cost model expects", None)
    blocks = sorted({block, *ADAPT_BLOCKS}) if adapt else [block]
    limit = target.config.text.max_position_embeddings
    needed = calibration_contexts(limit, end=context + max_tokens)
    st = store()
    key = machine_key(target.options) + "#" + shape_key(target, drafter)
    cal = st.calibration(key, blocks)
    missing = tuple(n for n in needed if cal is None or n not in cal.costs)
    seen = None
    if missing:
        note("calibrating the MTP gate (once per machine, model shape and context length: "
             f"{', '.join(map(str, missing))} tokens)")  # fmt: skip
        new = calibrate(runs, blocks, missing)
        st.put_calibration(key, new)
        seen = new.acceptance
        cal = Calibration((cal.costs if cal else {}) | new.costs)
    known = st.acceptance(pair)
    if known is None and seen is not None:  # this pair, if on a made-up prompt: beats the prior
        known = (seen, "measured while calibrating")
        st.put_acceptance(pair, *known)
    for msg in dict.fromkeys(st.notes):
        note(msg)
    acceptance, source = known or (PRIOR_ACCEPTANCE, "prior")
    decision = decide(cal, blocks, acceptance, source, context)
    later = None
    if not decision.engaged and max_tokens:
        later = first_paying(cal, blocks, acceptance, context, context + max_tokens)
    if later is not None:  # classic steps first, rounds once they pay
        decision = replace(decision, engaged=True, starts_at=later, reason=(
            decision.reason.rsplit("; ", 1)[0] + f"; below {MARGIN:.2f}x here, but expected to "
            f"clear it from about {later} tokens of context: classic steps until then, MTP "
            "rounds after"))  # fmt: skip
    # Round by round the acceptance seen and the context reached may move the block (where
    # adapting) or switch MTP off where no round pays, and on again.
    chooser = BlockChooser(cal, tuple(blocks), acceptance, starts_on=later is None)
    return replace(decision, chooser=chooser)


def remember(
    pair: str, stats: MTPStats | None, note: Callable[[str], None] = lambda msg: None
) -> None:
    """Keep this run's acceptance for the next decision on the same pair."""
    if stats is not None and stats.rounds:
        a = acceptance_estimate(stats)
        if a is not None:
            st = store()
            st.put_acceptance(pair, a)
            for msg in dict.fromkeys(st.notes):
                note(msg)
