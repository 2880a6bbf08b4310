"""The gate: engage MTP only where it is expected to beat classic decoding on this machine.

A round at block size b drafts k = b - 1 tokens and verifies b positions. With a per-draft
acceptance a (a draft counts only after all before it were accepted) a round emits
``E = 1 + a + ... + a^k`` tokens on average, and costs ``verify_ms[b] + k * draft_ms``. A
classic step costs ``step_ms`` per token. The expected speedup is ``E * step_ms / round_ms``;
MTP engages when it is at least ``MARGIN``.

The three costs come from a calibration measured once per machine and model shape (a few timed
forwards) and cached in ``cache_dir()/gate.json``; the acceptance comes from the last run of the
same target and drafter (``PRIOR_ACCEPTANCE`` before there is one).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from . import kernels
from .engine import MTPStats

PRIOR_ACCEPTANCE = 0.6
MARGIN = 1.05  # below a 5% expected gain, the variance of real prompts is not worth it
STORE_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """Measured costs, ms: a classic step, one drafter step, verify forwards by block size."""

    step_ms: float
    draft_ms: float
    verify_ms: dict[int, float]


@dataclass(frozen=True)
class GateDecision:
    engaged: bool
    reason: str
    expected_speedup: float | None
    acceptance: float | None
    acceptance_source: str  # "forced", "prior" or "last run"


def tokens_per_round(acceptance: float, drafts: int) -> float:
    """Expected tokens a round emits: the accepted prefix of ``drafts`` drafts, plus one."""
    return sum(acceptance**i for i in range(drafts + 1))


def expected_speedup(cal: Calibration, block: int, acceptance: float) -> float:
    k = block - 1
    round_ms = cal.verify_ms[block] + k * cal.draft_ms
    return tokens_per_round(acceptance, k) * cal.step_ms / round_ms


def decide(cal: Calibration, block: int, acceptance: float, source: str) -> GateDecision:
    speedup = expected_speedup(cal, block, acceptance)
    engaged = speedup >= MARGIN
    reason = (
        f"expected {speedup:.2f}x classic at block {block} with acceptance {acceptance:.2f} "
        f"({source}): a classic step costs {cal.step_ms:.2f} ms, a round "
        f"{cal.verify_ms[block] + (block - 1) * cal.draft_ms:.2f} ms "
        f"(verify {cal.verify_ms[block]:.2f} + {block - 1} drafts x {cal.draft_ms:.2f}); "
        + ("MTP engaged" if engaged else f"below {MARGIN:.2f}x, decoding classically")
    )
    return GateDecision(engaged, reason, speedup, acceptance, source)


def acceptance_estimate(stats: MTPStats) -> float | None:
    """The per-draft acceptance a of a run (maximum likelihood for the truncated chain)."""
    k = stats.block_size - 1
    examined = stats.accepted + (stats.rounds - stats.accept_histogram[k])
    return stats.accepted / examined if examined else None


def machine_key() -> str:
    """What the costs depend on besides the model: host, device, MLX, kernel choices."""
    try:
        device = mx.device_info().get("device_name", "")
    except (AttributeError, RuntimeError):
        device = ""
    return "|".join([platform.node(), platform.machine(), kernels.backend(), str(device),
                     mx.__version__, kernels.mode(), kernels.qmm()])  # fmt: skip


def shape_key(target, drafter) -> str:
    t = target.config.text
    q = target.config.quantization or {}
    return "|".join(str(v) for v in (
        target.config.model_type, t.hidden_size, t.num_hidden_layers, t.intermediate_size,
        t.vocab_size, t.linear_num_value_heads, t.num_attention_heads, t.num_experts, q.get("bits"),
        q.get("group_size"), (drafter.config.quantization or {}).get("bits"),
    ))  # fmt: skip


def calibrate(target, drafter, blocks: list[int], repeats: int = 3) -> Calibration:
    """Time a classic step, a drafter step and a verify of each block size on a short prompt."""
    from .bench import forward_cost, timed_ms

    prompt = mx.array([[(7 * i + 3) % min(1000, target.config.text.vocab_size) for i in range(16)]])
    cache = target.make_cache()
    hidden = target.prefill(prompt, cache)
    step = forward_cost(target, cache, 1, False, repeats)["median"]
    verify = {b: forward_cost(target, cache, b, True, repeats)["median"] for b in blocks}
    dcache = drafter.make_cache()
    drafter.forward(prompt[:, 1:], hidden[:, :-1], dcache)
    h, tok = hidden[:, -1:], prompt[:, -1:]

    def draft_step():
        out = drafter.forward(tok, h, dcache)
        mx.eval(target.lm_head(out))
        drafter.trim(dcache, 1)

    return Calibration(step, timed_ms(draft_step, repeats)["median"], verify)


class GateStore:
    """Calibrations and last acceptances, in one small JSON file (rewritten atomically)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = {"version": STORE_VERSION, "calibrations": {}, "acceptance": {}}
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data.get("version") == STORE_VERSION:
                self.data = data
        except (OSError, ValueError):
            pass  # missing or unreadable: start afresh, it is only a cache

    def calibration(self, key: str, blocks: list[int]) -> Calibration | None:
        c = self.data["calibrations"].get(key)
        if not c or any(str(b) not in c["verify_ms"] for b in blocks):
            return None
        return Calibration(
            c["step_ms"], c["draft_ms"], {int(b): v for b, v in c["verify_ms"].items()}
        )

    def put_calibration(self, key: str, cal: Calibration) -> None:
        old = self.data["calibrations"].get(key, {}).get("verify_ms", {})
        entry = asdict(cal)
        entry["verify_ms"] = old | {str(b): v for b, v in cal.verify_ms.items()}
        self.data["calibrations"][key] = entry
        self._save()

    def acceptance(self, pair: str) -> float | None:
        return self.data["acceptance"].get(pair)

    def put_acceptance(self, pair: str, value: float) -> None:
        self.data["acceptance"][pair] = value
        self._save()

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".gate-")
            with os.fdopen(fd, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache only costs a re-calibration next time


def store() -> GateStore:
    from .example import cache_dir

    return GateStore(cache_dir() / "gate.json")


def gate(
    target,
    drafter,
    block: int,
    pair: str,
    forced: bool = False,
    notify: Callable[[], None] | None = None,
) -> GateDecision:
    """Decide whether this run should use MTP (``forced``: ``--draft-kind mtp``); ``notify``
    is called before a calibration, which takes a few forwards."""
    if forced:
        return GateDecision(True, "forced by --draft-kind mtp", None, None, "forced")
    st = store()
    key = machine_key() + "#" + shape_key(target, drafter)
    cal = st.calibration(key, [block])
    if cal is None:
        if notify is not None:
            notify()
        cal = calibrate(target, drafter, [block])
        st.put_calibration(key, cal)
    last = st.acceptance(pair)
    if last is None:
        return decide(cal, block, PRIOR_ACCEPTANCE, "prior")
    return decide(cal, block, last, "last run")


def remember(pair: str, stats: MTPStats | None) -> None:
    """Keep this run's acceptance for the next decision on the same pair."""
    if stats is not None and stats.rounds:
        a = acceptance_estimate(stats)
        if a is not None:
            store().put_acceptance(pair, a)
