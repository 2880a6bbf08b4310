"""One generation as a user asks for it: the prompt encoded, the MTP gate, the engine it
chose, the text decoded as it streams, and what the gate should remember afterwards. The CLI
and other tools (a server, a notebook) call ``generate``."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from . import gate
from .config import check_block_size
from .engine.classic import generate_classic
from .engine.mtp import generate_mtp
from .engine.prompt_cache import PromptCache
from .engine.sampling import SamplingParams
from .errors import UsageError
from .loading import Loaded
from .models.pipeline import shared_seed
from .stats import GenerationStats
from .tokenizer import encode_with_ends


@dataclass
class GenerateResult:
    """What one ``generate`` call produced and decided."""

    text: str
    tokens: list[int]
    draft_kind: str  # what the drafter is: "mtp" or "none"
    block_size: int | None  # the block size MTP ran (or would have run) at
    mtp_engaged: bool
    gate_reason: str | None  # why the gate engaged MTP or kept it off
    expected_speedup: float | None  # the gate's prediction for this run, at the prompt
    stats: GenerationStats = field(default_factory=GenerationStats)
    # "stop" (EOS or a stop string), "length" (max_tokens reached) or "cancelled"
    finish_reason: str = "stop"
    # where MTP was engaged to start once the context has grown: from about this many tokens
    mtp_from_context: int | None = None

    def as_dict(self) -> dict:
        """The result as JSON-ready data (``mtp generate --json``)."""
        s, r = self.stats, self.stats.mtp
        stats = {
            "prompt_tokens": s.prompt_tokens,
            "prompt_cached_tokens": s.prompt_cached,
            "prompt_tps": s.prompt_tps,
            "generation_tokens": s.generation_tokens,
            "generation_tps": s.generation_tps,
            "peak_memory_gb": s.peak_memory_gb,
            "acceptance_rate": r.acceptance_rate if r else 0.0,
            "rounds": r.rounds if r else 0,
        }
        if r:
            stats |= {
                "drafted": r.drafted,
                "accepted": r.accepted,
                "acceptance_by_position": r.acceptance_by_position,
                "accept_histogram": r.accept_histogram,
                "rounds_by_block": {str(b): n for b, n in sorted(r.rounds_by_block.items())},
                "tokens_per_verify": r.tokens_per_verify,
                "draft_ms": r.draft_s * 1000,
                "verify_ms": r.verify_s * 1000,
                "verify_build_ms": r.verify_build_s * 1000,
                "rollback_ms": r.rollback_s * 1000,
                "classic_steps": r.classic_steps,
                "switches": [{"context": c, "mtp": on} for c, on in r.switches],
            }
        return {
            "text": self.text,
            "tokens": self.tokens,
            "draft_kind": self.draft_kind,
            "block_size": self.block_size,
            "mtp_engaged": self.mtp_engaged,
            "gate_reason": self.gate_reason,
            "expected_speedup": self.expected_speedup,
            "finish_reason": self.finish_reason,
            "mtp_from_context": self.mtp_from_context,
            "stats": stats,
        }


def _silent(_: str) -> None:
    pass


class StopText:
    """Streamed text cut before the first of ``stops``: ``feed`` returns what may be shown so
    far, holding back a tail that could begin a stop string."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""  # everything fed
        self.sent = 0  # how much of it ``feed`` returned
        self.hit = False

    def feed(self, segment: str) -> str:
        if self.hit:  # the text ended at the stop string
            return ""
        self.text += segment
        # a stop string cannot begin in text already sent: its first part would be held back
        found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if found:
            self.hit, end = True, min(found)
            self.text = self.text[:end]
        else:
            end = len(self.text) - max(
                (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])),
                default=0,
            )
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def flush(self) -> str:
        """The held-back tail, once no more text will come."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


def generate(
    pair: Loaded,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams = SamplingParams(),
    block_size: int | None = None,
    force_mtp: bool = False,
    system_prompt: str | None = None,
    chat_template: bool = True,
    seed: int | None = None,
    stop: Sequence[str] = (),
    cancelled: Callable[[], bool] = lambda: False,
    on_text: Callable[[str], None] = _silent,
    note: Callable[[str], None] = _silent,
    on_decision: Callable[[gate.GateDecision], None] = lambda decision: None,
    on_prefill: Callable[[int, int], None] | None = None,
    prompt_cache: PromptCache | None = None,
    boundaries: Collection[int] = (),
) -> GenerateResult:
    """Generate from ``prompt`` (text, through the chat template where the tokenizer has one
    and ``chat_template``; or token ids as they are) with the pair ``load_pair`` gave.

    With a drafter, the MTP gate decides whether MTP pays on this machine and, without
    ``block_size``, at which block size; ``force_mtp`` runs MTP regardless (at ``block_size``
    or the drafter's). ``on_text`` receives the text as it is decoded, ``note`` the gate's
    messages (calibration, a cache entry measured again), ``on_decision`` the gate's decision
    before decoding starts, ``on_prefill`` the prompt's progress (tokens done, total). With a
    ``prompt_cache`` the prompt resumes from the longest snapshot there that it starts with and
    leaves snapshots of its own (also at the token positions in ``boundaries``, say where its
    messages end), the tokens those of a cold start. Decoding
    ends at EOS, after ``max_tokens``, where the text first
    holds one of the ``stop`` strings (the text is cut before it, and no part of it is streamed),
    or once ``cancelled()`` says so (asked before each token). At temperature 0 the tokens are
    those of classic decoding whatever the gate decides.
    """
    if max_tokens < 1:
        raise UsageError(f"must be at least 1, got {max_tokens}", param="max_tokens")
    if block_size is not None:
        check_block_size(block_size)
        if pair.drafter is None:
            raise UsageError("needs a drafter, and the pair has none (no draft model given, or "
                             "draft kind none)", param="block_size")  # fmt: skip
    if force_mtp and pair.drafter is None:
        raise UsageError("needs a drafter, and the pair has none (no draft model given, or "
                         "draft kind none)", param="force_mtp")  # fmt: skip
    tokenizer, target = pair.tokenizer, pair.target
    if isinstance(prompt, str):
        ids, ends = encode_with_ends(tokenizer, prompt, system_prompt, not chat_template)
        boundaries = boundaries or ends
    else:
        ids = list(prompt)
    eos = pair.eos
    stage = target.stage
    if stage is not None and seed is None and not sampling.greedy:
        seed = shared_seed(stage)  # every stage samples the same tokens
    if seed is not None:
        mx.random.seed(seed)
    stats = GenerationStats()
    decision = None
    if pair.drafter is not None and stage is not None and not force_mtp:
        # Each process would time its own calibration and could decide otherwise: in a
        # pipeline MTP runs only when asked for, at a fixed block size.
        decision = gate.GateDecision(
            False,
            block_size or pair.drafter.block_size,
            "off in a pipeline unless forced (--draft-kind mtp)",
            None,
        )
        on_decision(decision)
    elif pair.drafter is not None:
        decision = gate.gate(
            target, pair.drafter, block_size or pair.drafter.block_size, pair.pair_key,
            gate_arms(target, pair.drafter), context=len(ids), max_tokens=max_tokens,
            forced=force_mtp,
            adapt=block_size is None, note=note,
        )  # fmt: skip
        on_decision(decision)
    engaged = decision is not None and decision.engaged
    if engaged:
        chooser = decision.chooser
        tokens = generate_mtp(target, pair.drafter, ids,
                              block_size=max(chooser.blocks) if chooser else decision.block,
                              max_tokens=max_tokens, sampling=sampling, eos_ids=eos,
                              stats=stats, choose_block=chooser,
                              on_prefill=on_prefill, prompt_cache=prompt_cache,
                              boundaries=boundaries)  # fmt: skip
    else:
        tokens = generate_classic(target, ids, max_tokens=max_tokens, sampling=sampling,
                                  eos_ids=eos, stats=stats, on_prefill=on_prefill,
                                  prompt_cache=prompt_cache, boundaries=boundaries)  # fmt: skip
    text = TextOut(tokenizer, stop, on_text)
    finish = None
    try:
        for t in tokens:
            if cancelled():
                finish = "cancelled"
                break
            if text.add(t):
                finish = "stop"
                break
    finally:
        tokens.close()  # the engine's own clean-up runs now, not when it is collected
    if engaged:
        gate.remember(pair.pair_key, stats.mtp, note=note)
    return text.result(pair, finish, max_tokens, stats, decision)


class TextOut:
    """A generation's tokens as streamed text: decoded as they come, cut before the first of
    the ``stop`` strings (``StopText``), handed to ``on_text``."""

    def __init__(self, tokenizer, stop: Sequence[str] = (),
                 on_text: Callable[[str], None] = _silent) -> None:  # fmt: skip
        self.detok = tokenizer.detokenizer  # a fresh one
        self.shown = StopText(stop)
        self.on_text = on_text
        self.ids: list[int] = []

    def add(self, token: int) -> bool:
        """Take one token; whether the text now holds a stop string (the generation ends)."""
        self.ids.append(token)
        self.detok.add_token(token)
        _emit(self.on_text, self.shown.feed(self.detok.last_segment))  # reading it advances it
        return self.shown.hit

    def result(self, pair: Loaded, finish: str | None, max_tokens: int, stats: GenerationStats,
               decision: gate.GateDecision | None = None) -> GenerateResult:  # fmt: skip
        """The text's end (``finish`` None: the tokens ran out, at EOS or ``max_tokens``)."""
        if finish is None:
            self.detok.finalize()
            _emit(self.on_text, self.shown.feed(self.detok.last_segment))
            finish = "length" if len(self.ids) >= max_tokens else "stop"
        _emit(self.on_text, self.shown.flush())
        return GenerateResult(
            text=self.shown.text, tokens=self.ids, draft_kind=pair.draft_kind,
            block_size=decision.block if decision else None,
            mtp_engaged=decision is not None and decision.engaged,
            gate_reason=decision.reason if decision else None,
            expected_speedup=decision.expected_speedup if decision else None, stats=stats,
            finish_reason=finish, mtp_from_context=decision.starts_at if decision else None,
        )  # fmt: skip


def made_up_prompt(length: int, vocab: int) -> list[int]:
    """``length`` token ids of no text, the same for every run (a context to time at)."""
    return [(7 * i + 3) % min(1000, vocab) for i in range(length)]


def gate_arms(target, drafter, tokens: int = 32) -> gate.Arms:
    """What the gate's calibration times: classic decoding and MTP at a block size, each a
    short greedy generation after a made-up prompt of the context's length, as the engines run
    them."""
    vocab = target.config.text.vocab_size

    def classic(context: int):
        return lambda stats: generate_classic(target, made_up_prompt(context, vocab),
                                              max_tokens=tokens, stats=stats)  # fmt: skip

    def mtp(block: int, context: int):
        return lambda stats: generate_mtp(target, drafter, made_up_prompt(context, vocab),
                                          block_size=block, max_tokens=tokens,
                                          stats=stats)  # fmt: skip

    return gate.Arms(classic, mtp)


def _emit(on_text: Callable[[str], None], text: str) -> None:
    if text:
        on_text(text)
