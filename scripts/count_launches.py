"""Count the graph nodes and kernel launches of a decode step and of an MTP round.

    python scripts/count_launches.py                         # the 27B's 64 layers, CUDA's graph
    python scripts/count_launches.py --shape qwen3.8-27b --json out.json   # on the GPU itself

On a machine without the backend's GPU, the graphs are built as that backend builds them
(``mtpcli.launches.structure_of``); on the GPU, as they run. The budget the counts are held to:
a decode step at most 300 launches, a block-3 round (drafts, verify, rollback) at most 450.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import mlx.core as mx

from mtpcli import kernels, launches, synthetic
from mtpcli.options import Options

BUDGET = {"decode_step": 300, "round": 450}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.8-27b-layers", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--bits", type=int, default=4, help="target bits; 16 for bf16")
    ap.add_argument("--block-size", type=int, default=3)
    ap.add_argument("--accepted", type=int, default=1, help="drafts the counted round accepts")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "metal"))
    ap.add_argument("--json", type=Path, default=None, help="write the record here")
    args = ap.parse_args()
    bits = None if args.bits == 16 else args.bits
    with launches.structure_of(args.backend):
        target, drafter = synthetic.build(args.shape, bits=bits, options=Options(submit_every=0))
        record = launches.budget(target, drafter, args.block_size, args.accepted)
    record |= {
        "shape": args.shape, "bits": args.bits, "structure": args.backend,
        "counted_on": kernels.backend(), "mlx": mx.__version__, "budget": BUDGET,
        "load": os.getloadavg(),
    }  # fmt: skip
    step, rnd = record["decode_step"], record["round"]
    rows = [("decode step", step)] + [(f"round: {p}", rnd[p]) for p in
                                      ("drafts", "verify", "rollback", "round")]  # fmt: skip
    print(f"{args.shape} {args.bits}-bit, block {args.block_size} accepting {args.accepted}, "
          f"{args.backend}'s graph counted on {kernels.backend()}")  # fmt: skip
    print(f"{'':18} {'nodes':>6} {'launches':>9}")
    for name, c in rows:
        print(f"{name:18} {c['nodes']:6} {c['launches']:9}")
    print(f"budget: step {BUDGET['decode_step']}, round {BUDGET['round']} launches")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
