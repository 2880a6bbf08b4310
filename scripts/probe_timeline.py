"""Where a decode step's and an MTP round's wall time goes on a CUDA GPU: the GPU's busy time.

    python scripts/probe_timeline.py --tokens 48 --out DIR          # 27B shape, 4-bit, random
    python scripts/probe_timeline.py --summary DIR/trace.json       # re-read a saved trace

MLX exposes no GPU timeline, but CUPTI traces every kernel of the process, whoever launched it:
the script runs our classic loop and our MTP loop (drafts swapped for the target's own tokens
with probability ``--simulate-acceptance``, as ``mtp bench`` does) under ``torch.profiler``
(PyTorch is only the tracer here), with each classic token and each MTP round marked on the
host (a round runs from one verify's build to the next). Per token and per round it reports
the wall time, the time at least one kernel ran (the union of the kernels' intervals inside
the window), and the kernel count; medians (min-max). A window whose busy time is well under
its wall time was paced by the host (building graphs, encoding launches), not by the kernels.
Per round it also reports the host's time in each phase (drafting, building the verify,
accept with its wait, the rollback) and the GPU's busy time during it. Settings such as
``MTP_SUBMIT_EVERY`` apply as in ``mtp``.

    python scripts/probe_timeline.py --tokens 48 --reps 4 --out DIR \
        --arm e8:MTP_SUBMIT_EVERY=8 --arm e4:MTP_SUBMIT_EVERY=4

runs an A/B in one process: each arm's settings are added to the environment for its MTP runs
(arms alternating, the order reversed every other time), and ``arms`` in the summary gives each
arm's rounds apart. Within one process the host's speed and the kernels' warmth are shared, which
across processes on this machine spread MTP's tok/s by +-10%. ``--host-profile`` then runs the
first arm again under cProfile (the host's time by function, in ``host_profile.txt``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest.mock import patch

from mtpcli.bench import parse_arm, spread
from mtpcli.models.qwen3_5 import submit_every

# The host's windows: a classic token, an MTP round (from its verify's build to the next's).
MARKS = {"token": "token", "verify": "round"}
PHASES = ("draft", "verify", "accept", "rollback")  # a round's host phases, marked as ranges


def busy_us(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """The length of the union of ``intervals`` (start, end) clipped to [lo, hi)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def windows(events: list[dict]) -> dict[str, list[dict]]:
    """A chrome trace's events -> per mark, each window's wall, GPU busy (us) and kernels."""
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "kernel" and "dur" in e)  # fmt: skip
    out: dict[str, list[dict]] = {name: [] for name in MARKS.values()}
    for mark, name in MARKS.items():
        starts = sorted(e["ts"] for e in events
                        if e.get("cat") == "user_annotation" and e.get("name") == mark)  # fmt: skip
        # a window ends where the next starts; the first (a classic run's holds its prefill) is
        # left out
        for lo, hi in list(zip(starts, starts[1:], strict=False))[1:]:
            inside = sum(1 for a, b in kernels if a >= lo and a < hi)
            out[name].append({"wall_us": hi - lo, "busy_us": busy_us(kernels, lo, hi),
                              "kernels": inside, "lo": lo, "hi": hi})  # fmt: skip
    return out


def phases(events: list[dict], rounds: list[dict]) -> dict[str, list[dict]]:
    """Per phase, per round: the host's time in that phase's ranges (us) and the GPU's busy
    time during them (a range belongs to the round it starts in)."""
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "kernel" and "dur" in e)  # fmt: skip
    out: dict[str, list[dict]] = {}
    for phase in PHASES:
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                 if e.get("cat") == "user_annotation" and e.get("name") == phase]  # fmt: skip
        out[phase] = [
            {"host_us": sum(b - a for a, b in spans if r["lo"] <= a < r["hi"]),
             "busy_us": sum(busy_us(kernels, a, b) for a, b in spans if r["lo"] <= a < r["hi"])}
            for r in rounds
        ]  # fmt: skip
    return out


def arm_ranges(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Per arm, the host ranges its MTP runs took (marked ``arm NAME``)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("arm "):
            out.setdefault(e["name"][4:], []).append((e["ts"], e["ts"] + e.get("dur", 0)))
    return out


def summary(events: list[dict]) -> dict:
    """Medians (min-max) per mark of wall ms, busy ms, busy / wall and kernels; with arms, the
    rounds of each arm apart (a round that crosses from one arm's run to the next is left out)."""

    def of(ws: list[dict]) -> dict:
        return {"n": len(ws),
                "wall_ms": spread([w["wall_us"] / 1e3 for w in ws]),
                "busy_ms": spread([w["busy_us"] / 1e3 for w in ws]),
                "busy_share": spread([w["busy_us"] / w["wall_us"] for w in ws]),
                "kernels": spread([w["kernels"] for w in ws])}  # fmt: skip

    def round_phases(rounds: list[dict]) -> dict:
        return {
            phase: {"host_ms": spread([p["host_us"] / 1e3 for p in per]),
                    "busy_ms": spread([p["busy_us"] / 1e3 for p in per])}
            for phase, per in phases(events, rounds).items()
        }  # fmt: skip

    res = {}
    found = windows(events)
    for name, ws in found.items():
        if ws:
            res[name] = of(ws)
    if found["round"]:
        res["round_phases"] = round_phases(found["round"])
    arms = arm_ranges(events)
    if arms:
        res["arms"] = {}
        for arm, ranges in arms.items():
            rounds = [w for w in found["round"]
                      if any(a <= w["lo"] and w["hi"] <= b for a, b in ranges)]  # fmt: skip
            if rounds:
                res["arms"][arm] = {"runs": len(ranges), "round": of(rounds),
                                    "round_phases": round_phases(rounds)}  # fmt: skip
    return res


@contextmanager
def settings(env: dict[str, str], target):
    """The environment with ``env`` added, ``MTP_SUBMIT_EVERY`` read again, for one run."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    target.submit_every = submit_every()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        target.submit_every = submit_every()


class _NoTracer:
    """``torch.profiler``'s surface, doing nothing (``--wall-only``)."""

    record_function = staticmethod(lambda name: nullcontext())
    profile = staticmethod(lambda activities: nullcontext())
    ProfilerActivity = argparse.Namespace(CPU=None, CUDA=None)


def run(args) -> tuple[list[dict], list[dict]]:
    """Our classic and MTP loops under the profiler: the trace's events, and each measured
    MTP run's arm, repetition, ms a round and tok/s.

    With arms (``args.arm``), the MTP loop runs ``args.reps`` times an arm, arms alternating
    (the order reversed every other time), each run marked ``arm NAME``; every run's tokens
    must equal classic's. With ``args.wall_only`` nothing is traced (no PyTorch needed) and a
    classic run of as many tokens is timed before each repetition's MTP runs (arm
    ``classic``)."""
    if args.wall_only:
        tp = _NoTracer
    else:
        try:
            import torch.profiler as tp
        except ImportError:
            sys.exit("probe_timeline: needs PyTorch (its profiler reads CUPTI's kernel trace)")
    import mlx.core as mx

    from mtpcli import synthetic
    from mtpcli.bench import simulated_drafts
    from mtpcli.engine import GenerationStats
    from mtpcli.engine import mtp as engine
    from mtpcli.engine.classic import generate_classic

    target, drafter = synthetic.build(args.shape, bits=args.bits)
    prompt = [(7 * i + 3) % 1000 for i in range(args.prompt_tokens)]
    reference = list(generate_classic(target, prompt, max_tokens=args.tokens + 8))
    arms = [parse_arm(a) for a in args.arm or ["as_set"]]

    def classic(n: int, mark: bool) -> GenerationStats:
        stats = GenerationStats()
        gen = generate_classic(target, prompt, max_tokens=n, stats=stats)
        while True:
            with tp.record_function("token") if mark else nullcontext():
                if next(gen, None) is None:
                    return stats

    def ranged(name: str, fn):
        def marked(*a, **kw):
            with tp.record_function(name):
                return fn(*a, **kw)

        return marked

    forward = target.forward

    def verify_marked(tokens, cache, *, verify=False):
        with tp.record_function("verify") if verify else nullcontext():
            return forward(tokens, cache, verify=verify)

    def mtp(n: int, env: dict[str, str]) -> GenerationStats:
        propose = simulated_drafts(reference, len(prompt), args.simulate_acceptance, seed=1)
        stats = GenerationStats()
        with (settings(env, target),
              patch.object(target, "forward", verify_marked),
              patch.object(engine, "accept", ranged("accept", engine.accept)),
              patch.object(engine, "rollback", ranged("rollback", engine.rollback))):  # fmt: skip
            gen = engine.generate_mtp(target, drafter, prompt, block_size=args.block_size,
                                      max_tokens=n, propose=ranged("draft", propose),
                                      stats=stats)  # fmt: skip
            out = list(gen)
        if out != reference[:n]:
            sys.exit(f"probe_timeline: MTP's tokens differ from classic's with {env}")
        return stats

    runs: list[dict] = []

    def timed(name: str, r: int, stats: GenerationStats) -> None:
        rounds = stats.mtp.rounds if stats.mtp else stats.generation_tokens
        runs.append({"arm": name, "rep": r, "tps": stats.generation_tps,
                     "round_ms": 1e3 * stats.generation_s / max(rounds, 1)})  # fmt: skip

    classic(16, False)  # warm-up: kernels, self-checks, traces
    for _, env in arms:
        mtp(16, env)
    mx.synchronize()
    acts = [tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]
    with tp.profile(activities=acts) as prof:
        classic(args.tokens, True)
        for r in range(args.reps):
            if args.wall_only:
                timed("classic", r, classic(args.tokens, False))
            for name, env in arms if r % 2 == 0 else arms[::-1]:
                with tp.record_function(f"arm {name}"):
                    timed(name, r, mtp(args.tokens, env))
        mx.synchronize()
    if args.host_profile:  # the host's side by function: cProfile over the first arm's runs
        host = cProfile.Profile()
        with host:
            for _ in range(args.reps):
                mtp(args.tokens, arms[0][1])
            mx.synchronize()
        with open(args.out / "host_profile.txt", "w") as f:
            pstats.Stats(host, stream=f).sort_stats("tottime").print_stats(60)
    if args.wall_only:
        return [], runs
    path = args.out / "trace.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"], runs


def wall_summary(runs: list[dict]) -> dict:
    """Per arm: medians (min-max) of ms a round (a token, for classic) and of tok/s, and of
    its tok/s over the first MTP arm's in the same repetition."""
    names = list(dict.fromkeys(r["arm"] for r in runs))
    first = next((n for n in names if n != "classic"), None)
    tps = {(r["arm"], r["rep"]): r["tps"] for r in runs}
    out = {}
    for name in names:
        mine = [r for r in runs if r["arm"] == name]
        out[name] = {"round_ms": spread([r["round_ms"] for r in mine], count=True),
                     "tps": spread([r["tps"] for r in mine], count=True)}  # fmt: skip
        paired = [r["tps"] / tps[(first, r["rep"])] for r in mine if (first, r["rep"]) in tps]
        if name != first and paired:
            out[name][f"tps_over_{first}"] = spread(paired, count=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3.8-27b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="the prompt's length")
    ap.add_argument("--block-size", type=int, default=3)
    ap.add_argument("--simulate-acceptance", type=float, default=0.7)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--arm", action="append", metavar="NAME:VAR=value,...",
                    help="an MTP arm: these settings added to the environment for its runs "
                         "(repeat for an in-process A/B)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=1, help="MTP runs an arm, arms alternating")
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="then the first arm's runs under cProfile (OUT/host_profile.txt)",
    )
    ap.add_argument(
        "--wall-only",
        action="store_true",
        help="no tracer: each run's wall time only, a classic run each repetition",
    )
    ap.add_argument("--summary", type=Path, help="summarise a saved trace, run nothing")
    args = ap.parse_args()
    if args.prompt_tokens < 1:
        ap.error(f"--prompt-tokens {args.prompt_tokens}: a prompt needs at least one token")
    if args.summary:
        events = json.loads(args.summary.read_text())["traceEvents"]
        res = {"trace": str(args.summary)}
    else:
        from mtpcli import kernels

        if kernels.backend() != "cuda" and not args.wall_only:
            sys.exit("probe_timeline: needs MLX's CUDA backend (CUPTI traces CUDA kernels)")
        args.out.mkdir(parents=True, exist_ok=True)
        load = os.getloadavg()
        events, runs = run(args)
        res = {"settings": vars(args) | {"out": str(args.out)}, "load_before": load,
               "load_after": os.getloadavg(), "runs": runs}  # fmt: skip
        if runs:
            res["wall"] = wall_summary(runs)
            print(json.dumps(res["wall"], indent=1))
    res["windows"] = summary(events)
    if events:
        print(json.dumps(res["windows"], indent=1))
    if not args.summary:
        (args.out / "timeline.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
