"""Prompt processing (prefill) of our classic engine against mlx-lm's ``generate_step`` on the
same target module and the same prompt tokens, alternating, each a median (min-max) of repeats.

    python scripts/bench_prefill.py                       # the built-in example, 2,761 tokens
    python scripts/bench_prefill.py --tokens 8192 --json out.json
    python scripts/bench_prefill.py --model /root/q27/target   # scripts/write_synthetic.py

Ours is timed to the first generated token (``GenerationStats.prompt_s``: the prefill and the
first pick), mlx-lm's likewise (its generator's first token).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtpcli.bench import stock_layers
from mtpcli.engine.classic import generate_classic
from mtpcli.example import ensure_example
from mtpcli.loading import load_pair
from mtpcli.stats import GenerationStats


def ours(target, prompt: list[int]) -> float:
    stats = GenerationStats()
    next(generate_classic(target, prompt, max_tokens=1, stats=stats), None)
    return len(prompt) / stats.prompt_s


def mlx_lm(target, prompt: list[int]) -> float:
    from mlx_lm.generate import generate_step

    with stock_layers(target.model):
        t0 = time.perf_counter()
        gen = generate_step(mx.array(prompt), target.model, max_tokens=1)
        int(next(gen)[0])
        return len(prompt) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2761)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None,
                    help="a target directory instead of the built-in example's")  # fmt: skip
    args = ap.parse_args()
    if args.tokens < 2 or args.repeats < 1:
        ap.error("--tokens must be at least 2 and --repeats at least 1")
    target = load_pair(str(args.model or ensure_example()[0])).target
    vocab = target.config.text.vocab_size
    prompt = [(i * 7919 + 13) % min(vocab, 4096) for i in range(args.tokens)]
    load = os.getloadavg()
    runs: dict[str, list[float]] = {"ours": [], "mlx_lm": []}
    ours(target, prompt[:64])
    mlx_lm(target, prompt[:64])
    for _ in range(args.repeats):
        runs["ours"].append(ours(target, prompt))
        runs["mlx_lm"].append(mlx_lm(target, prompt))
    summary = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
               for k, v in runs.items()}  # fmt: skip
    record = {
        "what": f"prompt tok/s, {args.tokens} tokens, target {args.model or 'built-in example'}",
        "tok_s": summary,
        "ours_vs_mlx_lm": summary["ours"]["median"] / summary["mlx_lm"]["median"],
        "machine": {"platform": platform.platform(), "device": str(mx.default_device()),
                    "cpus": os.cpu_count(), "load_before": load, "load_after": os.getloadavg()},
        "versions": {"mlx": mx.__version__},
        "command": "python scripts/bench_prefill.py " + " ".join(
            f"--{k} {v}" for k, v in (("tokens", args.tokens), ("repeats", args.repeats),
                                      ("model", args.model)) if v is not None),
    }  # fmt: skip
    for k, v in summary.items():
        print(f"{k}: {v['median']:.1f} tok/s ({v['min']:.1f}-{v['max']:.1f})")
    print(f"ours / mlx-lm: {record['ours_vs_mlx_lm']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
