"""Where a sampled process spent its time, by the innermost line of this project's code.

    py-spy record --threads --idle --rate 250 --format raw -o stacks.txt -- \\
        python scripts/probe_timeline.py --wall-only --tokens 64 --reps 4 --arm base --out DIR
    python scripts/stacks_summary.py stacks.txt --within generate_mtp --without prefill

py-spy's raw output is one line per distinct stack, frames root first separated by ``;``, then
the sample count. Each sample inside ``--within`` (and not inside ``--without``) is charged to
the innermost frame of this project (``mtpcli/`` or ``scripts/``), so a call into MLX's C++ (an
``mx.async_eval``, a compiled function, a wait) counts at the line that made it. With
``--idle`` py-spy keeps the samples where the thread waits, so the shares are of wall time.
``--leaf`` charges each sample to its innermost frame instead: with ``py-spy --native``, MLX's
own functions (its encoding, its waits).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

OURS = ("mtpcli/", "scripts/")


def shares(lines, within: str, without: tuple[str, ...] = (),
           leaf: bool = False) -> tuple[int, dict[str, float]]:  # fmt: skip
    """(samples counted, {innermost project frame: share of them}), largest first; with
    ``leaf``, the innermost frame of all (a native function, with ``py-spy --native``)."""
    by_line: collections.Counter = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if not any(within in f for f in frames) or any(w in f for f in frames for w in without):
            continue
        ours = [f for f in frames if any(o in f for o in OURS)] if not leaf else []
        by_line[ours[-1] if ours else frames[-1]] += int(count)
        total += int(count)
    return total, {k: v / total for k, v in by_line.most_common()} if total else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stacks", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--within", required=True, help="count samples whose stack has this frame")
    ap.add_argument("--without", action="append", default=[], help="and not this one")
    ap.add_argument(
        "--leaf", action="store_true", help="charge each sample to its innermost frame, ours or not"
    )
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with args.stacks.open() as f:
        total, found = shares(f, args.within, tuple(args.without), args.leaf)
    if args.json:
        print(json.dumps({"samples": total, "shares": found}, indent=1))
        return
    print(f"{total} samples within {args.within}")
    for frame, share in list(found.items())[: args.top]:
        print(f"{100 * share:5.1f}%  {frame}")


if __name__ == "__main__":
    main()
