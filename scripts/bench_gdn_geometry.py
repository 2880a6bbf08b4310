"""The gated-delta kernel (the conv folded in, the product's variant) at several threadgroup
geometries: W warps of R value rows, launch bound MB blocks a multiprocessor.

    ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum \\
        -k regex:mtp_gated_delta python scripts/bench_gdn_geometry.py > DIR/sweep.csv
    python scripts/bench_gdn_geometry.py --summary DIR/sweep.csv     # the table
    ncu ... python scripts/bench_gdn_geometry.py --with 4 6 scripts/profile_step.py --t 3

One layer of the 27B shape (16 key heads, 48 value heads, 128 x 128, conv width 4), bf16:
each geometry launched at T = 1 (no states, as a decode step), T = 2, 3, 4, 8 with states and
T = 3 without, REPEATS times each between cuProfilerStart and Stop, after one launch that
compiles it and whose outputs are compared bitwise with the first geometry's (a row's
arithmetic depends on neither W nor R, so any difference is a bug). The launch order and the
comparisons are printed as one JSON line after the profile; ``--summary`` maps the CSV back to
it (a count that differs is an error). ``--with W MB SCRIPT ARGS`` runs another script with the
kernel's geometry set, for a whole step under the profiler. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import sys
from pathlib import Path

import mlx.core as mx

from mtpcli.kernels import gated_delta as gd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qmm import kernel_durations_us, profiled  # noqa: E402 - a sibling script

HK, HV, DK, DV, K = 16, 48, 128, 128, 4
NC = 2 * HK * DK + HV * DV
GEOMETRIES = [(8, 2, 3), (4, 2, 6), (8, 4, 2), (4, 4, 4)]  # R even: a row a half-warp or two
CASES = [(1, False), (2, True), (3, True), (3, False), (4, True), (8, True)]
REPEATS = 5


def _set(warps: int, rows: int | None, min_blocks: int) -> None:
    gd._WARPS, gd.CONV_MIN_BLOCKS = warps, min_blocks
    if rows is not None:
        gd._ROWS = rows
    gd._kernels.clear()


def _inputs(T: int) -> tuple:
    """A layer's inputs as the model passes them: qkv and a, b as views of wider outputs."""
    mx.random.seed(100 + T)
    qkv = mx.random.normal((1, T, NC + 64)).astype(mx.bfloat16)[..., 32 : 32 + NC]
    window = mx.random.normal((1, K - 1, NC)).astype(mx.bfloat16)
    conv_w = (mx.random.normal((NC, K, 1)) * 0.5).astype(mx.bfloat16)
    ab = mx.random.normal((1, T, 2 * HV)).astype(mx.bfloat16)  # [1, T, 2 Hv]
    A_log, dt_bias = mx.linspace(-2, 1, HV), mx.linspace(-1, 1, HV).astype(mx.bfloat16)
    state = mx.random.normal((1, HV, DV, DK)) * 0.1  # [B, Hv, Dv, Dk]
    args = (qkv, window, conv_w, ab[..., :HV], ab[..., HV:], A_log, dt_bias, state)
    mx.eval(args)
    return args


def sweep() -> None:
    inputs = {T: _inputs(T) for T in sorted({T for T, _ in CASES})}
    order, first, bitwise = [], {}, {}
    for geometry in GEOMETRIES:
        _set(*geometry)
        for T, keep in CASES:

            def launch(T=T, keep=keep):
                return gd.gated_delta_conv_native(*inputs[T], (HK, DK, HV, DV), keep_states=keep)

            out = launch()
            mx.eval(out)
            if (T, keep) in first:
                bitwise[f"{geometry} T{T} keep {keep}"] = all(
                    bool(mx.array_equal(a, b).item())
                    for a, b in zip(out, first[(T, keep)], strict=True) if a is not None
                )  # fmt: skip
            else:
                first[(T, keep)] = out
            profiled(launch, REPEATS)
            order.append([list(geometry), T, keep])
    print(json.dumps({"order": order, "bitwise_vs_first": bitwise}))


def summary(text: str) -> dict:
    """The profile (ncu's CSV followed by ``sweep``'s JSON line) as medians, min and max (us)
    by geometry and case; prints the table."""
    lines = text.splitlines()
    meta = next((json.loads(x) for x in reversed(lines) if x.startswith('{"order"')), None)
    try:
        us = kernel_durations_us(text)
    except ValueError:
        us = None
    if meta is None or us is None:
        raise SystemExit("not a sweep's profile: no ncu CSV header or no launch order line")
    if len(us) != len(meta["order"]) * REPEATS:
        plan = len(meta["order"])
        raise SystemExit(f"{len(us)} kernels profiled, the plan has {plan} x {REPEATS}")
    table: dict = {}
    for i, (geometry, T, keep) in enumerate(meta["order"]):
        xs = us[i * REPEATS : (i + 1) * REPEATS]
        case = f"T{T}{' states' if keep else ''}"
        table.setdefault(str(tuple(geometry)), {})[case] = [statistics.median(xs), min(xs), max(xs)]
    cases = list(dict.fromkeys(c for row in table.values() for c in row))  # launch order
    ratios = [c for c in ("T3 states", "T3") if c in cases and "T1" in cases]
    print("| W, R, MB | " + " | ".join(cases + [f"{c} / T1" for c in ratios]) + " |")
    print("|---" * (len(cases) + len(ratios) + 1) + "|")
    for geometry, row in table.items():
        cells = [f"{row[c][0]:.2f}" if c in row else "" for c in cases]
        cells += [f"{row[c][0] / row['T1'][0]:.3f}" for c in ratios]
        print(f"| {geometry} | " + " | ".join(cells) + " |")
    return {"us_median_min_max": table, "bitwise_vs_first": meta["bitwise_vs_first"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", default=None, help="the profile's CSV (with the JSON line)")
    ap.add_argument("--json", action="store_true", help="with --summary: the raw numbers too")
    ap.add_argument("--with", dest="with_", nargs=argparse.REMAINDER, default=None,
                    help="W MB SCRIPT ARGS: run SCRIPT with that geometry")  # fmt: skip
    args = ap.parse_args()
    if args.summary:
        out = summary(Path(args.summary).read_text())
        if args.json:
            print(json.dumps(out))
    elif args.with_:
        warps, min_blocks, *rest = args.with_
        _set(int(warps), None, int(min_blocks))
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")
    else:
        sweep()


if __name__ == "__main__":
    main()
