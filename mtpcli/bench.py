"""``mtp bench``: classic and MTP decoding side by side, and the verify-cost table.

Every figure is a median over repeats with min-max, on the same weights and prompts in one
run, with the machine, its load and the versions beside it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .engine.classic import generate_classic
from .engine.mtp import draft, generate_mtp
from .engine.mtp_batch import draft_rows
from .errors import PromptError, UsageError
from .files import read_bounded
from .kernels import backend as kernel_backend
from .models.quantized_layers import stock_layers
from .options import Options
from .stats import GenerationStats, MTPStats

DEFAULT_PROMPTS = [
    "Explain in detail how a transformer neural network works, covering attention, "
    "feed-forward layers, normalization, and training.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List the steps to make a cup of tea, then explain why each step matters.",
]


def spread(values: list[float], count: bool = False) -> dict:
    out = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out | {"n": len(values)} if count else out


def machine() -> dict:
    """Backend, device, versions and load: printed beside every figure."""
    import importlib.metadata as md

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    if mx.default_device() == mx.cpu:
        device = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
        backend = "cpu"
    else:
        info = mx.device_info()
        device = str(info.get("device_name", "gpu"))
        backend = kernel_backend()
    return {
        "backend": backend,
        "device": device,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "mlx_vlm": version("mlx-vlm"),
        "mtp": version("mtp"),
    }


def timed_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn()
    mx.synchronize()
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        ms.append((time.perf_counter() - t0) * 1000)
    return spread(ms)


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-empty line; a line that is a JSON string literal is decoded (for
    prompts with newlines)."""
    data = read_bounded(path, "--prompts file", error=PromptError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"--prompts {path} is not UTF-8 text (byte {e.start})") from e
    texts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                line = json.loads(line)
            except json.JSONDecodeError:
                pass  # a prompt that merely starts with a quote
            try:  # a JSON string can spell a lone surrogate, which no text can hold
                line.encode("utf-8")
            except UnicodeEncodeError as e:
                raise PromptError(
                    f"--prompts {path} line {number}: its JSON string decodes to a lone "
                    f"surrogate (U+{ord(line[e.start]):04X}), which is not text"
                ) from e
        texts.append(line)
    if not texts:
        raise UsageError(f"--prompts {path} holds no prompt")
    return texts


def forward_cost(target, cache: list, T: int, verify: bool, repeats: int) -> dict:
    """ms of one forward of T tokens (LM head included) on top of ``cache``, left unchanged."""
    x = mx.random.randint(0, target.config.text.vocab_size, (1, T))
    saved = [c.offset if hasattr(c, "offset") else list(c.cache) for c in cache]

    def run():
        out = target.forward(x, cache, verify=verify)
        mx.eval(target.lm_head(out.hidden, exact=verify), target.cache_arrays(cache))
        for c, s in zip(cache, saved, strict=True):
            if hasattr(c, "offset"):
                c.offset = s
            else:
                c.cache = list(s)

    # Warm-up covers the row policy's first comparisons, which compute each op twice.
    return timed_ms(run, repeats, warmup=4)


def verify_cost_table(target, prompt: list[int], repeats: int, ts=range(1, 9)) -> dict:
    """Verify path and plain prefill path, T = 1..8, with ratios to T = 1."""
    cache = target.make_cache()
    target.prefill(mx.array([prompt]), cache)
    table = {"verify_ms": {}, "prefill_ms": {}}
    for T in ts:
        table["verify_ms"][T] = forward_cost(target, cache, T, True, repeats)
        table["prefill_ms"][T] = forward_cost(target, cache, T, False, repeats)
    base = table["verify_ms"][1]["median"]
    table["ratio"] = {T: v["median"] / base for T, v in table["verify_ms"].items()}
    return table


def simulated_drafts(reference: list[int], p: float, seed: int):
    """A ``draft`` that swaps each draft for the target's own next token with probability p.

    ``reference`` is the classic greedy continuation, which at temperature 0 is exactly what
    the target would say next. The drafter still runs and the target still verifies. Whether
    the draft for output position j is swapped depends on (seed, j) alone, so the same
    positions get the same swaps whatever the rounds before them did. The swaps are looked up
    on the device, since a round built ahead knows its position only there.
    """
    n = len(reference)
    swap = mx.array([random.Random(seed * 1_000_003 + j).random() < p for j in range(n)]
                    + [False])  # fmt: skip
    own = mx.array([*reference, 0], mx.uint32)  # [n + 1]: past the reference, no swap

    def propose(drafter, target, catch, cache, k, s, position):
        drafts, q = draft(drafter, target, catch, cache, k, s, position)
        j = mx.minimum(position + 1 + mx.arange(k), n)  # [k]: the drafts' output positions
        return mx.where(swap[j], own[j].astype(drafts.dtype), drafts), q

    return propose


def simulated_row_drafts(references: Sequence[list[int]], p: float, seed: int):
    """``simulated_drafts`` for a batch's rounds (``engine/mtp_batch.draft_rows``'s signature):
    the draft of the request owned by o for its output position j is swapped for
    ``references[o][j]`` with probability p, as decided by (seed, o, j) alone (a request's, not
    its row's: rows move as others leave)."""

    def propose(drafter, target, cache, h, k, rows):
        drafts = draft_rows(drafter, target, cache, h, k)  # [B, k]
        swap, own = [], []
        for owner, at in rows:
            ref = references[owner]
            js = [at + 1 + i for i in range(k)]
            swap.append([j < len(ref) and random.Random((seed * 1_000_003 + owner) * 1_000_003
                                                        + j).random() < p for j in js])  # fmt: skip
            own.append([ref[j] if j < len(ref) else 0 for j in js])
        return mx.where(mx.array(swap), mx.array(own, mx.uint32).astype(drafts.dtype), drafts)

    return propose


@dataclass
class Arm:
    name: str
    block_size: int | None
    tps: list[float] = field(default_factory=list)
    peak_memory_gb: float = 0.0
    acceptance: list[float] = field(default_factory=list)
    by_position: list[list[float]] = field(default_factory=list)
    tokens_per_verify: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    verify_ms: list[float] = field(default_factory=list)
    verify_build_ms: list[float] = field(default_factory=list)  # of verify_ms: the host's build
    rollback_ms: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    # where the gate's chooser ran the rounds: its switches (context, MTP on after) per run
    switches: list[list[tuple[int, bool]]] = field(default_factory=list)
    classic_steps: list[int] = field(default_factory=list)
    conditions: list[dict] = field(default_factory=list)  # per repeat: ``conditions()``

    def summary(self) -> dict:
        out = {
            "name": self.name,
            "block_size": self.block_size,
            "tps": spread(self.tps),
            "peak_memory_gb": self.peak_memory_gb,
        }
        if self.conditions:
            out["repeats"] = [{"tps": t, **c} for t, c in zip(self.tps, self.conditions,
                                                             strict=True)]  # fmt: skip
        if self.switches:
            out |= {"switches": self.switches[-1], "classic_steps": spread(self.classic_steps)}
        if self.block_size and self.acceptance:
            out |= {
                "acceptance_rate": spread(self.acceptance),
                "acceptance_by_position": [
                    statistics.median(c) for c in zip(*self.by_position, strict=True)
                ],
                "tokens_per_verify": spread(self.tokens_per_verify),
                "draft_ms_per_round": spread(self.draft_ms),
                "verify_ms_per_round": spread(self.verify_ms),
                "verify_build_ms_per_round": spread(self.verify_build_ms),
                "rollback_ms_per_round": spread(self.rollback_ms),
            }
        return out


GPU_QUERY = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw",
             "clocks_event_reasons.active")  # fmt: skip


def conditions() -> dict:
    """What the machine was like as a repeat ended, for runs whose repeats spread: the host's
    load and, where ``nvidia-smi`` answers, the GPU's clocks (MHz), temperature, power and
    the active clock-event (throttle) reasons of the first GPU; read after the repeat, so they
    do not slow it."""
    out: dict = {"load_1min": round(os.getloadavg()[0], 2)}
    smi = shutil.which("nvidia-smi")
    gpu: dict = {}
    # the throttle reasons apart: a driver that lacks the field fails the whole query
    for fields in (GPU_QUERY[:-1], GPU_QUERY[-1:]):
        values = _first_gpu(smi, fields) if smi else None
        if values is not None:
            gpu |= dict(zip(fields, values, strict=True))
    return out | ({"gpu": gpu} if gpu else {})


def _first_gpu(smi: str, fields: tuple[str, ...]) -> list[str] | None:
    """``fields`` of the first GPU as ``nvidia-smi`` reports them, or None."""
    try:
        done = subprocess.run([smi, f"--query-gpu={','.join(fields)}",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=5, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.splitlines()
    values = [v.strip() for v in lines[0].split(",")] if lines else []
    return values if len(values) == len(fields) else None


def run_arm(arm: Arm, generate: Callable[[GenerationStats], list[int]]) -> None:
    # Every run starts from an empty buffer cache, whatever ran before it: a peer's cached
    # buffers would otherwise slow the next arm down.
    mx.clear_cache()
    stats = GenerationStats()
    tokens = generate(stats)
    arm.tokens.append(tokens)
    arm.tps.append(stats.generation_tps)
    arm.peak_memory_gb = max(arm.peak_memory_gb, stats.peak_memory_gb)
    r = stats.mtp
    if r is not None and (r.switches or r.classic_steps):
        arm.switches.append(r.switches)
        arm.classic_steps.append(r.classic_steps)
    if r is not None and r.rounds:
        per_round = 1000 / r.rounds
        arm.acceptance.append(r.acceptance_rate)
        arm.by_position.append(r.acceptance_by_position)
        arm.tokens_per_verify.append(r.tokens_per_verify)
        arm.draft_ms.append(r.draft_s * per_round)
        arm.verify_ms.append(r.verify_s * per_round)
        arm.verify_build_ms.append(r.verify_build_s * per_round)
        arm.rollback_ms.append(r.rollback_s * per_round)


def compare(
    target,
    drafter,
    prompts: list[list[int]],
    *,
    blocks: list[int],
    max_tokens: int,
    repeats: int,
    simulate: float | None = None,
    peers: bool = False,
    vlm: MlxVlmPeer | None = None,
    quantized: dict[int, object] | None = None,
    gated: Callable[[MTPStats, int], int] | None = None,
    read_first: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    """Run every arm ``repeats`` times over ``prompts``; one tok/s figure per repeat.
    ``quantized`` maps bits to a quantized copy of ``drafter``: MTP arms with each, beside the
    drafter's own. ``gated`` (the gate's round-by-round chooser) adds an MTP arm whose rounds
    it picks, classic steps included, as ``mtp generate`` runs them. ``read_first`` adds MTP
    arms that read each round before building the next (the engine's ``build_ahead=False``)."""
    quantized = quantized or {}
    arms = {"classic": Arm("classic", None)}
    arms |= {f"mtp-{b}": Arm(f"mtp block {b}", b) for b in blocks}
    arms |= {f"mtp-{b}-q{q}": Arm(f"mtp block {b}, {q}-bit drafter", b)
             for q in quantized for b in blocks}  # fmt: skip
    drafters = {f"mtp-{b}": drafter for b in blocks}
    if read_first:
        arms |= {f"mtp-{b}-read": Arm(f"mtp block {b}, rounds read first", b) for b in blocks}
        drafters |= {f"mtp-{b}-read": drafter for b in blocks}
    drafters |= {f"mtp-{b}-q{q}": d for q, d in quantized.items() for b in blocks}
    if gated is not None:
        arms["mtp-gated"] = Arm("mtp, rounds chosen by the gate", max(blocks))
        drafters["mtp-gated"] = drafter
    if peers:
        arms["mlx_lm"] = Arm("mlx-lm classic (peer)", None)
    if vlm is not None:
        arms |= {f"mlx_vlm-{b}": Arm(f"mlx-vlm mtp block {b} (peer)", None) for b in blocks}
    progress("warm-up: compiling kernels, greedy references")
    references = _warm_up(target, [drafter, *quantized.values()], prompts, blocks, max_tokens,
                          vlm)  # fmt: skip
    for rep in range(repeats):
        for key, arm in arms.items():
            progress(f"repeat {rep + 1}/{repeats}: {arm.name}")
            per_prompt = Arm(arm.name, arm.block_size)
            for i, prompt in enumerate(prompts):
                if key == "classic":
                    run_arm(
                        per_prompt,
                        lambda s, p=prompt: list(
                            generate_classic(target, p, max_tokens=max_tokens, stats=s)
                        ),
                    )
                elif key == "mlx_lm":
                    run_arm(
                        per_prompt, lambda s, p=prompt: _mlx_lm_greedy(target, p, max_tokens, s)
                    )
                elif key.startswith("mlx_vlm-"):
                    b = int(key.split("-")[1])
                    run_arm(per_prompt, lambda s, p=prompt, b=b: vlm.greedy(p, max_tokens, b, s))
                else:
                    propose = (
                        simulated_drafts(references[tuple(prompt)], simulate, rep * 97 + i)
                        if simulate is not None
                        else draft
                    )
                    choose = gated if key == "mtp-gated" else None
                    built_ahead = not key.endswith("-read")
                    run_arm(
                        per_prompt,
                        lambda s, p=prompt, b=arm.block_size, pr=propose, d=drafters[key],
                        c=choose, a=built_ahead: list(generate_mtp(
                            target, d, p, block_size=b, max_tokens=max_tokens, stats=s,
                            propose=pr, choose_block=c, build_ahead=a)),
                    )  # fmt: skip
            _merge(arm, per_prompt)
            arm.conditions.append(conditions())
    result = {k: a.summary() for k, a in arms.items()}
    classic_tokens = arms["classic"].tokens[: len(prompts)]
    for key, arm in arms.items():
        if key != "classic":
            result[key]["same_tokens_as_classic"] = arm.tokens[: len(prompts)] == classic_tokens
    return result


def _warm_up(target, drafters: list, prompts, blocks, max_tokens: int, vlm) -> dict:
    """Run every prompt through each path once, untimed (kernel compilation, self-checks,
    traces of the compiled layer functions); returns each prompt's greedy classic tokens."""
    references = {}
    for prompt in prompts:
        references[tuple(prompt)] = list(generate_classic(target, prompt, max_tokens=max_tokens))
        for b in blocks:
            for drafter in drafters:
                list(generate_mtp(target, drafter, prompt, block_size=b, max_tokens=8))
            if vlm is not None:
                vlm.greedy(prompt, 8, b, GenerationStats())
    return references


def _merge(arm: Arm, per_prompt: Arm) -> None:
    # One figure per repeat: the harmonic mean of the prompts' tok/s is total tokens / total time.
    n = [len(t) for t in per_prompt.tokens]
    seconds = sum(k / tps for k, tps in zip(n, per_prompt.tps, strict=True) if tps)
    arm.tps.append(sum(n) / seconds if seconds else 0.0)
    arm.tokens.extend(per_prompt.tokens)
    arm.peak_memory_gb = max(arm.peak_memory_gb, per_prompt.peak_memory_gb)
    arm.switches.extend(per_prompt.switches)
    arm.classic_steps.extend(per_prompt.classic_steps)
    for name in (
        "acceptance",
        "tokens_per_verify",
        "draft_ms",
        "verify_ms",
        "verify_build_ms",
        "rollback_ms",
    ):
        values = getattr(per_prompt, name)
        if values:
            getattr(arm, name).append(statistics.mean(values))
    if per_prompt.by_position:
        arm.by_position.append(
            [statistics.mean(c) for c in zip(*per_prompt.by_position, strict=True)]
        )


def _mlx_lm_greedy(target, prompt: list[int], max_tokens: int, stats: GenerationStats):
    """mlx-lm's own decoding loop on the same module (the classic peer)."""
    from mlx_lm.generate import generate_step

    with stock_layers(target.model):  # mlx's own quantized matmuls, as mlx-lm runs them
        gen = generate_step(mx.array(prompt), target.model, max_tokens=max_tokens)
        tokens = [int(next(gen)[0])]
        start = time.perf_counter()
        tokens += [int(t) for t, _ in gen]
    stats.generation_tokens = len(tokens) - 1
    stats.generation_s = time.perf_counter() - start
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    return tokens


class MlxVlmPeer:
    """mlx-vlm's own MTP decoding (``mlx_vlm.speculative``) on the same checkpoint directories.

    Loaded with ``strict=False`` because a target's vision tower is never used here (and the
    built-in example carries only a placeholder of it). Drafts are always real for this peer:
    ``--simulate-acceptance`` does not reach into it.
    """

    def __init__(self, target_dir, drafter_dir):
        from mlx_vlm import load
        from mlx_vlm.speculative.drafters import load_drafter

        self.model, self.processor = load(str(target_dir), strict=False)
        self.drafter, self.kind = load_drafter(str(drafter_dir))

    @staticmethod
    def available() -> bool:
        import importlib.util

        return importlib.util.find_spec("mlx_vlm") is not None

    def greedy(self, prompt: list[int], max_tokens: int, block: int, stats: GenerationStats):
        from mlx_vlm.generate.dispatch import stream_generate

        results = stream_generate(
            self.model, self.processor, "", input_ids=mx.array([prompt]), max_tokens=max_tokens,
            temperature=0.0, draft_model=self.drafter, draft_kind=self.kind,
            draft_block_size=block,
        )  # fmt: skip
        tokens, start = [], None
        for r in results:
            if r.finish_reason is not None:  # the closing summary repeats the last token
                break
            tokens.append(int(r.token))
            start = start or time.perf_counter()  # time from the first token, as for ours
        stats.generation_tokens = max(len(tokens) - 1, 0)
        stats.generation_s = time.perf_counter() - start if start else 0.0
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        return tokens


def _fit_acceptance(tokens_per_verify: float, drafts: int) -> float:
    """The per-draft acceptance a whose E(a) = 1 + a + ... + a^k is the measured figure."""
    from .gate import tokens_per_round

    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(mid, drafts) < tokens_per_verify else (lo, mid)
    return (lo + hi) / 2


def calibrate(target, drafter, blocks: list[int], repeats: int, end: int):
    """A fresh calibration of the gate, as ``mtp generate`` would make it on this machine for a
    generation that ends at ``end`` tokens of context."""
    from . import gate
    from .generation import gate_arms

    contexts = gate.calibration_contexts(target.config.text.max_position_embeddings, end)
    return gate.calibrate(gate_arms(target, drafter), blocks, contexts, repeats=max(3, repeats))


def gate_check(cal, result: dict, blocks: list[int], context: int) -> dict:
    """What the gate's cost model predicts for each arm at ``context`` tokens (from the
    calibration ``cal`` and the arm's measured tokens per verify) beside the speedup the arm
    measured."""
    from . import gate

    classic = result["classic"]["tps"]["median"]
    out = {"calibration": {str(n): {"step_ms": c.step_ms, "round_ms": c.round_ms}
                           for n, c in cal.costs.items()}, "context": context}  # fmt: skip
    for b in blocks:
        arm = result[f"mtp-{b}"]
        a = _fit_acceptance(arm["tokens_per_verify"]["median"], b - 1)
        predicted = gate.expected_speedup(cal, b, a, context)
        out[b] = {
            "acceptance_fit": a,
            "predicted_speedup": predicted,
            "measured_speedup": arm["tps"]["median"] / classic if classic else 0.0,
            "gate_engages": predicted >= gate.MARGIN,
        }
    return out


def to_json(
    result: dict, table: dict | None, info: dict, settings: dict, gate: dict | None = None
) -> dict:
    classic = result["classic"]["tps"]["median"]
    mtp = {k[4:]: v for k, v in result.items() if k.startswith("mtp-")}  # "3", "3-q4"
    return {
        "machine": info,
        "settings": settings,
        "classic_tps": classic,
        "mtp_tps": {b: v["tps"]["median"] for b, v in mtp.items()},
        "speedup": {b: v["tps"]["median"] / classic if classic else 0.0 for b, v in mtp.items()},
        "acceptance_rate": {
            b: v["acceptance_rate"]["median"] for b, v in mtp.items() if "acceptance_rate" in v
        },
        "verify_cost": {T: v["median"] for T, v in (table or {}).get("verify_ms", {}).items()},
        "arms": result,
        "verify_cost_table": table,
        "gate": gate,
    }


def _submitted(st: dict) -> str:
    """How verify blocks were submitted, for the report's settings line."""
    n = st.get("submit_every")
    if n is None:  # a report from before the setting was recorded
        return ""
    if not n:
        return ", each verify block submitted at its wait"
    return f", verify blocks submitted every {n} layers"


def markdown(doc: dict) -> str:
    """The report: arms table, per-position acceptance, verify-cost table, machine."""
    info, st = doc["machine"], doc["settings"]

    def cell(d: dict, f: str = "{:.2f}") -> str:
        return f"{f.format(d['median'])} ({f.format(d['min'])}-{f.format(d['max'])})"

    sim = st["simulate_acceptance"]
    lines = [
        f"# mtp bench: {st['model']}",
        "",
        f"{info['device']} ({info['backend']}); MLX {info['mlx']}, mlx-lm {info['mlx_lm']}"
        + (f", mlx-vlm {info['mlx_vlm']}" if info.get("mlx_vlm") else "")
        + "; load "
        f"{tuple(round(x, 2) for x in info['load_before'])} before, "
        f"{tuple(round(x, 2) for x in info['load_after'])} after. {st['prompts']} prompts x "
        f"{st['max_tokens']} tokens, {st['repeats']} repeats; figures are median (min-max). "
        f"Kernels {st.get('kernels', 'auto')}, quantized matmul {st.get('qmm', 'mlx')}"
        f"{_submitted(st)}."
        + (
            f" The target's layers split over {st['processes']} processes (mlx.launch); the "
            "machine line is rank 0's."
            if st.get("processes", 1) > 1
            else ""
        ),
        "",
        f"Command: `{st.get('command', 'mtp bench')}`",
    ]
    if sim is not None:
        lines += [
            "",
            f"**Simulated acceptance**: each draft was replaced by the target's own next "
            f"token with probability {sim}; acceptance figures below are simulated (our arms "
            "only: the peers' drafts are real).",
        ]
    for note in st.get("peer_notes", []):
        lines += ["", f"Peer note: {note}."]
    if "contexts" in doc:
        for row in doc["contexts"]:
            lines += ["", f"## At {row['context']} tokens of context"]
            lines += _result_lines(row)
    else:
        lines += _result_lines(doc)
    table = doc.get("verify_cost_table")
    if table:
        lines += [
            "",
            "Verify cost (one forward of T tokens after the first prompt, LM head included, ms):",
            "",
            "| T | verify path | plain prefill path | verify / T=1 |",
            "|---|---|---|---|",
        ]
        for T, v in table["verify_ms"].items():
            lines.append(
                f"| {T} | {cell(v)} | {cell(table['prefill_ms'][T])} | {table['ratio'][T]:.2f} |"
            )
    return "\n".join(lines) + "\n"


def _result_lines(doc: dict) -> list[str]:
    """One run's arms table, acceptance by position and the gate's check."""

    def cell(d: dict, f: str = "{:.2f}") -> str:
        return f"{f.format(d['median'])} ({f.format(d['min'])}-{f.format(d['max'])})"

    lines: list[str] = []
    lines += [
        "",
        "| arm | tok/s | vs classic | acceptance | tokens/verify | draft ms | verify ms "
        "| of which building | rollback ms | peak GB | tokens = classic |",
        "|" + "---|" * 11,
    ]
    classic = doc["classic_tps"]
    for arm in doc["arms"].values():
        ratio = arm["tps"]["median"] / classic if classic else 0.0
        if "acceptance_rate" in arm:
            extra = [
                cell(arm["acceptance_rate"], "{:.3f}"),
                cell(arm["tokens_per_verify"]),
                cell(arm["draft_ms_per_round"]),
                cell(arm["verify_ms_per_round"]),
                cell(arm["verify_build_ms_per_round"]),
                cell(arm["rollback_ms_per_round"]),
            ]
        else:
            extra = ["-"] * 6
        same = arm.get("same_tokens_as_classic", "-")
        lines.append(
            f"| {arm['name']} | {cell(arm['tps'])} | {ratio:.2f}x | "
            + " | ".join(extra)
            + f" | {arm['peak_memory_gb']:.2f} | {same} |"
        )
    for arm in doc["arms"].values():
        if "acceptance_rate" in arm:
            per = ", ".join(f"{a:.3f}" for a in arm["acceptance_by_position"])
            lines.append(f"\nAcceptance by draft position, {arm['name']}: {per}")
        if "switches" in arm:
            steps = arm["classic_steps"]["median"]
            lines.append(
                f"\n{arm['name']}: MTP switched "
                + (", ".join(f"{'on' if on else 'off'} at {c} tokens" for c, on in arm["switches"])
                   or "never")
                + f" (last run; median {steps:.0f} tokens by classic steps)"
            )  # fmt: skip
    g = doc.get("gate")
    if g:
        costs = "; ".join(
            f"at {n} tokens of context a classic step {c['step_ms']:.2f} ms, rounds "
            + ", ".join(f"block {b} {v:.2f} ms" for b, v in c["round_ms"].items())
            for n, c in g["calibration"].items()
        )
        lines += [
            "",
            f"The gate's cost model at {g['context']} tokens of context (its calibration: "
            f"{costs}), fed each arm's measured tokens per verify, against the measured speedup:",
            "",
            "| block | fitted acceptance | predicted | measured | gate engages |",
            "|---|---|---|---|---|",
        ]
        for b, v in g.items():
            if b not in ("calibration", "context"):
                lines.append(
                    f"| {b} | {v['acceptance_fit']:.3f} | {v['predicted_speedup']:.2f}x | "
                    f"{v['measured_speedup']:.2f}x | {'yes' if v['gate_engages'] else 'no'} |"
                )
    return lines


def _prompt_ids(texts: list[str], tokenizer) -> list[list[int]]:
    if tokenizer is not None:
        return [tokenizer.encode(t) for t in texts]
    # random weights know no tokenizer: fixed pseudo-random ids of the same lengths
    return [[(i * 7919 + 13 * j) % 1000 + 1 for j in range(len(t) // 4 + 1)]
            for i, t in enumerate(texts)]  # fmt: skip


def run(
    model: str | None = None,
    draft_model: str | None = None,
    *,
    synthetic: str | None = None,
    bits: int = 4,
    blocks: Sequence[int] = (3,),
    repeats: int = 5,
    max_tokens: int = 256,
    prompts_file: Path | None = None,
    simulate: float | None = None,
    peers: bool = False,
    verify_table: bool = True,
    draft_quantize: Sequence[int] = (),
    contexts: Sequence[int] = (),
    read_first: bool = False,
    check_gate: bool = True,
    options: Options = Options(),
    command: str = "",
    progress: Callable[[str], None] = lambda msg: None,
) -> dict:
    """The whole ``mtp bench``: load (the built-in example without ``model``; random weights of
    a real shape with ``synthetic``), run the arms and peers, the verify-cost table and the
    gate's check; ``draft_quantize`` adds MTP arms with the drafter quantized to those bits.
    With ``contexts`` the arms run after a prompt of each of those lengths instead (the first
    prompt's tokens repeated), beside an arm whose rounds the gate chooses, and the gate's
    prediction is made at each length. ``read_first`` adds MTP arms that read each round
    before building the next. ``check_gate=False`` skips the gate's calibration and its
    prediction beside the arms (not with ``contexts``, whose arm the gate drives). Returns the
    report's document (``markdown`` renders it)."""
    from . import gate
    from . import synthetic as S
    from .config import check_block_size
    from .drafters.qwen3_5_mtp import check_quantize, quantized_copy
    from .example import ensure_example, example_prompts
    from .generation import gate_arms
    from .loading import load_pair

    for b in blocks:
        check_block_size(b)
    for q in draft_quantize:
        check_quantize(q)
    for n in contexts:
        if n < 1:
            raise UsageError(f"must be at least 1, got {n}", param="context")
    if simulate is not None and not 0 <= simulate <= 1:
        raise UsageError(f"--simulate-acceptance must be in [0, 1], got {simulate}")
    texts = read_prompts(prompts_file) if prompts_file is not None else None
    load_before = os.getloadavg()
    on_example = model is None and not synthetic
    if synthetic:
        if synthetic not in S.SHAPES:
            raise UsageError(f"--synthetic must be one of {', '.join(S.SHAPES)}, got {synthetic!r}")
        if bits not in (4, 8, 16):
            raise UsageError(f"--bits must be 4, 8 or 16, got {bits}")
        target, drafter = S.build(synthetic, bits=None if bits == 16 else bits, options=options)
        tokenizer, label = None, f"synthetic {synthetic} {bits}-bit (random weights)"
    else:
        label = model or "built-in example (1M parameters, trained on Python's stdlib)"
        if on_example:
            t, d = ensure_example()
            model, draft_model = str(t), draft_model or str(d)
        loaded = load_pair(model, draft_model, "mtp", options)
        target, drafter, tokenizer = loaded.target, loaded.drafter, loaded.tokenizer
    vlm, peer_notes = None, []
    if peers:
        if synthetic:
            peer_notes.append("mlx-vlm: not run (it loads checkpoints from disk: write this pair "
                              "with scripts/write_synthetic.py and pass -m)")  # fmt: skip
        elif not MlxVlmPeer.available():
            peer_notes.append("mlx-vlm: not installed, not run")
        else:
            try:
                vlm = MlxVlmPeer(loaded.target_dir, loaded.drafter_dir)
            except Exception as e:  # a peer that cannot load this pair is a note, not a stop
                peer_notes.append(f"mlx-vlm: could not load this pair ({type(e).__name__}: {e})")
    if texts is None:
        texts = example_prompts()[:3] if on_example else DEFAULT_PROMPTS
    prompts = _prompt_ids(texts, tokenizer)
    limit = target.config.text.max_position_embeddings
    for n in contexts:
        if n + max_tokens > limit:
            raise UsageError(f"of {n} tokens leaves no room for {max_tokens} generated ones "
                             f"within the model's {limit} positions", param="context")  # fmt: skip
    quantized = {q: quantized_copy(drafter, q, options) for q in dict.fromkeys(draft_quantize)}
    settings = {
        "command": command, "model": label, "blocks": list(blocks), "repeats": repeats,
        "max_tokens": max_tokens, "prompts": len(prompts), "simulate_acceptance": simulate,
        "peers": peers, "kernels": options.kernels, "draft_quantize": sorted(quantized),
        "qmm": options.qmm_label,
        "submit_every": target.submit_every, "peer_notes": peer_notes,
        "processes": target.stage.size if target.stage is not None else 1,
    }  # fmt: skip
    if contexts:
        progress("gate calibration")
        cal = calibrate(target, drafter, list(blocks), repeats, max(contexts) + max_tokens)
        prior = simulate if simulate is not None else cal.acceptance or gate.PRIOR_ACCEPTANCE
        chooser = gate.BlockChooser(cal, tuple(blocks), prior)
        rows = []
        for n in contexts:
            prompt = (prompts[0] * (n // len(prompts[0]) + 1))[:n]  # [n]
            result = compare(target, drafter, [prompt], blocks=list(blocks),
                             max_tokens=max_tokens, repeats=repeats, simulate=simulate,
                             peers=peers, quantized=quantized, gated=chooser,
                             read_first=read_first,
                             progress=lambda msg, n=n: progress(f"context {n}: {msg}"))  # fmt: skip
            row = to_json(result, None, {}, {}, gate_check(cal, result, list(blocks), n))
            rows.append({"context": n} | {k: v for k, v in row.items()
                                          if k not in ("machine", "settings")})  # fmt: skip
        info = machine() | {"load_before": load_before, "load_after": os.getloadavg()}
        settings |= {"prompts": 1, "contexts": list(contexts)}
        return {"machine": info, "settings": settings, "contexts": rows}
    result = compare(target, drafter, prompts, blocks=list(blocks), max_tokens=max_tokens,
                     repeats=repeats, simulate=simulate, peers=peers, vlm=vlm,
                     quantized=quantized, read_first=read_first,
                     progress=progress)  # fmt: skip
    progress("verify-cost table")
    table = verify_cost_table(target, prompts[0], max(3, repeats)) if verify_table else None
    gate_doc = None
    if check_gate:
        progress("gate calibration")
        # The prompts are short: the gate's costs at its shortest context. Split over
        # processes (mlx.launch), every rank must run as many generations: a fixed count, not
        # as many as fit a time budget (each rank would time its own).
        budget = math.inf if target.stage is not None else 2.0
        cal = gate.calibrate(gate_arms(target, drafter), list(blocks), repeats=max(3, repeats),
                             budget_s=budget)  # fmt: skip
        gate_doc = gate_check(cal, result, list(blocks), gate.SHORT)
    info = machine() | {"load_before": load_before, "load_after": os.getloadavg()}
    return to_json(result, table, info, settings, gate_doc)
