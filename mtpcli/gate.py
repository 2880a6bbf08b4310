"""The gate: engage MTP only where it is expected to beat classic decoding on this machine.

A round at block size b drafts k = b - 1 tokens and verifies b positions. With a per-draft
acceptance a (a draft counts only after all before it were accepted) a round emits
``E = 1 + a + ... + a^k`` tokens on average. A round costs ``round_ms[b]`` and a classic step
``step_ms`` per token, both timed as the engines run them (so pipelining, the drafter's
catch-up, the rollback and Python overhead are all in). The expected speedup is
``E * step_ms / round_ms[b]``; MTP engages when it is at least ``MARGIN``.

The costs come from a calibration measured once per machine and model shape (a few short
generations) and cached in ``cache_dir()/gate.json``; the acceptance from the last run of the
same target and drafter (before there is one, the acceptance seen in the calibration's own MTP
runs when it has just calibrated, else ``PRIOR_ACCEPTANCE``; the model takes a to be
the same at every draft position, so it carries over between block sizes). When no block size
was asked for, the gate also picks the block size with the best expected speedup.
"""

from __future__ import annotations

import contextlib
import fcntl
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
STORE_VERSION = 3


@dataclass(frozen=True)
class Calibration:
    """Measured costs, ms: a classic step (per token, pipelined as it runs) and a whole MTP
    round (draft, verify, accept, roll back, emit) by block size."""

    step_ms: float
    round_ms: dict[int, float]
    # per-draft acceptance seen in the timed MTP runs (of this pair; not kept with the costs)
    acceptance: float | None = None


@dataclass(frozen=True)
class GateDecision:
    engaged: bool
    block: int  # the block size to run (chosen among the candidates when adapting)
    reason: str  # names the acceptance used and where it came from
    expected_speedup: float | None  # None when forced
    # where the gate chose the block: it may change it round by round as acceptance is seen
    chooser: BlockChooser | None = None


def tokens_per_round(acceptance: float, drafts: int) -> float:
    """Expected tokens a round emits: the accepted prefix of ``drafts`` drafts, plus one."""
    return sum(acceptance**i for i in range(drafts + 1))


def expected_speedup(cal: Calibration, block: int, acceptance: float) -> float:
    return tokens_per_round(acceptance, block - 1) * cal.step_ms / cal.round_ms[block]


def decide(cal: Calibration, blocks: list[int], acceptance: float, source: str) -> GateDecision:
    """The best of ``blocks`` by expected speedup, engaged if that clears ``MARGIN``."""
    speedups = {b: expected_speedup(cal, b, acceptance) for b in blocks}
    block = max(blocks, key=lambda b: (speedups[b], -b))  # ties: the smaller block
    speedup = speedups[block]
    engaged = speedup >= MARGIN
    others = ", ".join(f"{b}: {v:.2f}x" for b, v in speedups.items() if b != block)
    reason = (
        f"expected {speedup:.2f}x classic at block {block} with acceptance {acceptance:.2f} "
        f"({source}): a classic step costs {cal.step_ms:.2f} ms, a round of "
        f"{block - 1} draft{'s' if block > 2 else ''} and a verify {cal.round_ms[block]:.2f} ms"
        + (f" (other blocks {others})" if others else "")
        + "; "
        + ("MTP engaged" if engaged else f"below {MARGIN:.2f}x, decoding classically")
    )
    return GateDecision(engaged, block, reason, speedup)


def acceptance_estimate(stats: MTPStats) -> float | None:
    """The per-draft acceptance a of a run (maximum likelihood for the truncated chain)."""
    return stats.accepted / stats.examined if stats.examined else None


@dataclass(frozen=True)
class BlockChooser:
    """Each round's block size, from the acceptance seen so far in the generation: the
    acceptance the gate decided with counts as ``weight`` examined drafts, the run's own
    drafts as themselves; the block with the best expected speedup under ``cal`` wins."""

    cal: Calibration
    blocks: tuple[int, ...]
    prior: float
    weight: float = 8.0

    def __call__(self, stats: MTPStats) -> int:
        a = (self.prior * self.weight + stats.accepted) / (self.weight + stats.examined)
        speedups = {b: expected_speedup(self.cal, b, a) for b in self.blocks}
        return max(self.blocks, key=lambda b: (speedups[b], -b))


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
    """What the gate times: classic decoding, and MTP at a block size (short generations
    from one prompt, as the engines run them; ``generation.gate_arms`` builds them)."""

    classic: Run
    mtp: Callable[[int], Run]


def calibrate(
    runs: Arms,
    blocks: list[int],
    repeats: int = 5,
    budget_s: float = 2.0,
) -> Calibration:
    """Time classic decoding and MTP rounds of each block size, as they run.

    Each is run once to warm up; then rounds of one run of each, alternating, so that a change
    in the machine's speed (clocks, other load) reaches both sides alike, up to ``repeats``
    rounds, stopping early once the measured rounds took ``budget_s`` per side (a large model
    is timed fewer times: its runs are long and steadier). The fastest run of each is kept:
    other load only ever slows a run down.
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

    arms = {0: runs.classic} | {b: runs.mtp(b) for b in blocks}  # 0: the classic step
    for run in arms.values():
        list(run(GenerationStats()))  # warm-up: kernel compilation, caches
    vals: dict[int, list[float]] = {key: [] for key in arms}
    start = time.perf_counter()
    while len(vals[0]) < repeats and (
        not vals[0] or time.perf_counter() - start < budget_s * len(arms)
    ):
        for key, run in arms.items():
            vals[key].append(measured(run))
    step, rounds = min(vals[0]), {b: min(vals[b]) for b in blocks}
    return Calibration(step, rounds, seen[0] / seen[1] if seen[1] else None)


MAX_MS = 1e5  # a step or round of 100 s is no measurement of a model we run
MIN_MS = 1e-3  # nor one of a microsecond: a launch alone costs more
LOCK_WAIT_S = 10.0  # how long a write waits for another run's lock before giving up
MAX_STORE_BYTES = 4 << 20


def _ms(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and MIN_MS <= v <= MAX_MS


def _valid_calibration(c) -> bool:
    if not isinstance(c, dict):
        return False
    rounds = c.get("round_ms")
    return (
        _ms(c.get("step_ms"))
        and isinstance(rounds, dict)
        and bool(rounds)
        # ASCII digits only: "²".isdigit() is true, and int() refuses it
        and all(
            b.isascii() and b.isdigit() and BLOCK_MIN <= int(b) <= BLOCK_MAX and _ms(v)
            for b, v in rounds.items()
        )
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
        c = self.data["calibrations"].get(key)
        if not c or any(str(b) not in c["round_ms"] for b in blocks):
            return None
        return Calibration(c["step_ms"], {int(b): v for b, v in c["round_ms"].items()})

    def put_calibration(self, key: str, cal: Calibration) -> None:
        def put(data: dict) -> None:
            old = data["calibrations"].get(key, {}).get("round_ms", {})
            rounds = old | {str(b): v for b, v in cal.round_ms.items()}
            data["calibrations"][key] = {"step_ms": cal.step_ms, "round_ms": rounds}

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
    forced: bool = False,
    adapt: bool = False,
    note: Callable[[str], None] = lambda msg: None,
) -> GateDecision:
    """Decide whether this run should use MTP, and at which block size.

    ``runs`` are what a calibration times (when this machine and shape have none cached);
    ``forced`` (``--draft-kind mtp``) runs MTP at ``block``; ``adapt`` (no block size asked
    for) lets the gate pick among ``ADAPT_BLOCKS`` and ``block``; ``note`` is told before a
    calibration (a few short generations) and of any problem with the cache.
    """
    if forced:
        return GateDecision(True, block, "forced: MTP runs whatever the cost model expects", None)
    blocks = sorted({block, *ADAPT_BLOCKS}) if adapt else [block]
    st = store()
    key = machine_key(target.options) + "#" + shape_key(target, drafter)
    cal = st.calibration(key, blocks)
    seen = None
    if cal is None:
        note("calibrating the MTP gate (once per machine and model shape)")
        cal = calibrate(runs, blocks)
        st.put_calibration(key, cal)
        seen = cal.acceptance
    known = st.acceptance(pair)
    if known is None and seen is not None:  # this pair, if on a made-up prompt: beats the prior
        known = (seen, "measured while calibrating")
        st.put_acceptance(pair, *known)
    for msg in dict.fromkeys(st.notes):
        note(msg)
    acceptance, source = known or (PRIOR_ACCEPTANCE, "prior")
    decision = decide(cal, blocks, acceptance, source)
    if adapt and len(blocks) > 1:
        decision = replace(decision, chooser=BlockChooser(cal, tuple(blocks), acceptance))
    return decision


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
