"""Classic decode tok/s run after run in one process, before and after the mlx-lm peer.

    [MLX_USE_CUDA_GRAPHS=0 | MLX_CUDA_GRAPH_CACHE_SIZE=4000] \
        python scripts/probe_run_after_run.py [--clear] --out DIR --tag NAME

The synthetic 27B 4-bit target (our product), one 40-token prompt, 64 tokens a run: one
untimed run, ``--runs`` runs, mlx-lm's generate_step once (the peer, on MLX's own layer
classes), ``--after`` runs; tok/s and MLX's buffer-cache size after each run. ``--clear``
empties the buffer cache before each run. Where ``mtp bench`` figures sit below
``bench_verify.py --decode-only`` ones, this shows whether the runs before are the cause.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import mlx.core as mx

from mtpcli import synthetic
from mtpcli.bench import _mlx_lm_greedy
from mtpcli.engine import GenerationStats
from mtpcli.engine.classic import generate_classic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.8-27b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--after", type=int, default=4)
    ap.add_argument("--clear", action="store_true")
    ap.add_argument("--tag", default="default")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    target, _ = synthetic.build(args.shape, bits=4)
    prompt = list(range(100, 140))

    def classic() -> tuple[float, float]:
        if args.clear:
            mx.clear_cache()
        stats = GenerationStats()
        list(generate_classic(target, prompt, max_tokens=64, stats=stats))
        return round(stats.generation_tps, 1), round(mx.get_cache_memory() / 1e9, 2)

    classic()  # kernel compilation, traces
    alone = [classic() for _ in range(args.runs)]
    _mlx_lm_greedy(target, prompt, 64, GenerationStats())
    after = [classic() for _ in range(args.after)]
    res = {"tag": args.tag, "alone": alone, "after_peer": after, "clear": args.clear,
           "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
           "load_after": os.getloadavg()}  # fmt: skip
    print(json.dumps(res), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"run_after_run_{args.tag}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
