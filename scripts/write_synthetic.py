"""Write a random-weight pair of a real shape to disk, in the layouts users download.

`mtp bench --synthetic NAME` builds the pair in memory; peers that only load checkpoints from
disk (mlx-vlm's MTP decoding) need it written out. The files hold exactly the weights that
`--synthetic NAME` builds (same seed), so both benches run the same model:

    python scripts/write_synthetic.py qwen3.8-27b /tmp/q27 --bits 4
    mtp bench -m /tmp/q27/target --draft-model /tmp/q27/drafter --peers
    python scripts/write_synthetic.py tiny /tmp/raw --bits 16 --raw   # a raw HF checkpoint
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mtpcli import synthetic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(synthetic.SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8, 16))
    ap.add_argument("--raw", action="store_true", help="one raw HF checkpoint with mtp.* (bf16)")
    args = ap.parse_args()
    if args.raw and args.bits != 16:
        ap.error("--raw writes a bf16 checkpoint: pass --bits 16")
    start = time.perf_counter()
    paths = synthetic.write(args.shape, args.out, None if args.bits == 16 else args.bits,
                            raw=args.raw)  # fmt: skip
    print(f"wrote {' and '.join(map(str, paths))} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
