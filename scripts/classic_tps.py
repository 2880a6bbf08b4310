"""Classic decoding's tok/s on a random-weight model of a real shape, runs after a warm-up:
the figure to compare two trees of this project by, each run from its own checkout.

    cd <checkout> && python scripts/classic_tps.py --shape qwen3.8-27b --bits 4 --runs 4

Prints the sorted tok/s of every run but the first (the warm-up: kernel compilation, traces).
Older trees import ``GenerationStats`` from ``mtpcli.engine``; both places are tried.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from mtpcli import synthetic  # noqa: E402
from mtpcli.engine.classic import generate_classic  # noqa: E402

try:
    from mtpcli.stats import GenerationStats  # noqa: E402
except ImportError:  # trees before stats.py
    from mtpcli.engine import GenerationStats  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.8-27b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    target, _ = synthetic.build(args.shape, args.bits)
    prompt = [(7 * i + 3) % 1000 for i in range(16)]
    tps = []
    for run in range(args.runs):
        stats = GenerationStats()
        list(generate_classic(target, prompt, max_tokens=args.tokens, stats=stats))
        if run:
            tps.append(round(stats.generation_tps, 2))
    print(f"{args.shape} {args.bits}-bit classic tok/s, runs 2-{args.runs}: {sorted(tps)}")


if __name__ == "__main__":
    main()
