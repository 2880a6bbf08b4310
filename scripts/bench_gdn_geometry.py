"""The gated-delta kernel (the conv folded in, the product's variant) at several threadgroup
geometries: W warps of R value rows, launch bound MB blocks a multiprocessor, L lanes a row,
H value heads (of one key head) a threadgroup.

    ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum \\
        -k regex:mtp_gated_delta python scripts/bench_gdn_geometry.py > DIR/sweep.csv
    python scripts/bench_gdn_geometry.py --summary DIR/sweep.csv     # the table
    ncu ... python scripts/bench_gdn_geometry.py --with 4 6 scripts/profile_step.py --t 3
    ncu ... -k regex:gated_delta python scripts/bench_gdn_geometry.py --step 1 3 > DIR/steps.csv
    python scripts/bench_gdn_geometry.py --summary DIR/steps.csv     # a step's 48 launches
    git show REV:mtpcli/kernels/gated_delta.py > /tmp/gd_rev.py
    ncu ... python scripts/bench_gdn_geometry.py --module /tmp/gd_rev.py --dump /tmp/rev.safetensors
    python scripts/bench_gdn_geometry.py --compare /tmp/rev.safetensors /tmp/head.safetensors

One layer of the 27B shape (16 key heads, 48 value heads, 128 x 128, conv width 4), bf16:
each geometry launched at T = 1 (no states, as a decode step), T = 2, 3, 4, 8 with states and
T = 3 without, REPEATS times each between cuProfilerStart and Stop, after one launch that
compiles it and whose outputs are compared bitwise with the first geometry's of the same L (a
row's arithmetic depends on neither W nor R, so any difference is a bug; L sets how a lane's
columns are summed). The launch order and the
comparisons are printed as one JSON line after the profile; ``--summary`` maps the CSV back to
it (a count that differs is an error). After the profile each geometry's T = 3 launch with
states is checked against three chained one-step launches (bitwise: chain parity, what MTP ==
classic rests on) and the ops reference (largest difference); ``--dump`` saves the first
geometry's outputs for ``--compare`` with another version's. ``--with W MB SCRIPT ARGS`` runs
another script with the kernel's geometry set, for a whole step under the profiler.

``--step T ...`` profiles the product's steps instead: the 27B-shape 4-bit model after a
64-token prompt, REPEATS decode steps (T = 1) or verify blocks (T > 1, states kept, rolled back
after each) per T after a warm-up; under ``-k regex:gated_delta`` the summary is the sum of a
step's 48 launches, median (min-max) of the REPEATS steps, and each T's ratio to T = 1.
``--module FILE`` runs another version of ``mtpcli/kernels/gated_delta.py`` (an earlier
commit's, an experiment) in its place, for either; ``--geometry W R MB L`` one geometry for
either (the sweep's only one, the steps' kernel at every T; without it, the steps run the
product's: narrow below ``_WIDE_FROM`` steps, wide from there). Needs CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import runpy
import statistics
import sys
from pathlib import Path

import mlx.core as mx

import mtpcli.kernels
from mtpcli.kernels import gated_delta as gd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qmm import kernel_durations_us, profiled  # noqa: E402 - a sibling script

HK, HV, DK, DV, K = 16, 48, 128, 128, 4
NC = 2 * HK * DK + HV * DV
# (W, R, MB, L, H): R a multiple of 32 / L, W of H (H divides 48 / 16)
GEOMETRIES = [(8, 2, 3, 16, 1), (12, 2, 2, 16, 3), (24, 2, 1, 16, 3), (6, 2, 4, 16, 3)]
CASES = [(1, False), (2, True), (3, True), (3, False), (4, True), (8, True)]
REPEATS = 5


def _set(warps: int, rows: int | None, min_blocks: int, lanes: int | None = None,
         heads: int = 1) -> None:  # fmt: skip
    """One geometry at every T (the product's goes wide for longer blocks: none here)."""
    gd._WARPS, gd.CONV_MIN_BLOCKS, gd._HEADS, gd._WIDE = warps, min_blocks, heads, None
    if rows is not None:
        gd._ROWS = rows
    if lanes is not None:
        gd._LANES = lanes
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


def use_module(path: Path):
    """``path``, another version of the gated-delta module, installed in its place: later
    imports take it, and so do the names already imported from the old one (the model's
    ``gated_delta_conv``, imported here through bench_qmm before any option is read)."""
    global gd
    old = sys.modules.get("mtpcli.kernels.gated_delta")
    spec = importlib.util.spec_from_file_location("mtpcli.kernels.gated_delta", path)
    gd = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gd
    spec.loader.exec_module(gd)
    mtpcli.kernels.gated_delta = gd
    names = {id(v): k for k, v in vars(old).items()} if old is not None else {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("mtpcli") or module in (gd, old):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in names and hasattr(gd, names[id(value)]):
                setattr(module, attr, getattr(gd, names[id(value)]))
    return gd


def chain_check(launch, T: int = 3) -> dict:
    """``launch`` (``gated_delta_conv_native``'s signature) at T with states against T chained
    one-step launches, each from the last one's state and window: whether y, the states, the
    final state and the window are bitwise equal; and the largest difference from the ops
    reference."""
    heads = (HK, DK, HV, DV)
    qkv, window, conv_w, a, b, A_log, dt_bias, state = _inputs(T)
    y, final, states, _, new_window = launch(qkv, window, conv_w, a, b, A_log, dt_bias, state,
                                             heads, keep_states=True)  # fmt: skip
    ys, kept, w, s = [], [], window, state
    for t in range(T):
        step = (qkv[:, t : t + 1], w, conv_w, a[:, t : t + 1], b[:, t : t + 1])
        y_t, s, _, _, w = launch(*step, A_log, dt_bias, s, heads)
        ys.append(y_t)
        kept.append(s)
    want = gd.gated_delta_conv_ops(qkv, window, conv_w, a, b, A_log, dt_bias, state, heads,
                                   keep_states=True)  # fmt: skip
    chained = (mx.concatenate(ys, axis=1), mx.stack(kept[:-1]), s, w)

    def diff(x, z):
        return mx.abs(x.astype(mx.float32) - z.astype(mx.float32)).max().item()

    return {
        "chain_bitwise": all(bool(mx.array_equal(x, z).item())
                             for x, z in zip((y, states, final, new_window), chained, strict=True)),
        "max_diff_vs_ops": {"y": diff(y, want[0]), "state": diff(final, want[1]),
                            "states": diff(states, want[2])},
    }  # fmt: skip


def compare(paths: list[Path]) -> dict:
    """Whether the outputs ``--dump`` saved in each file are bitwise the first file's."""
    first = mx.load(str(paths[0]))
    out = {}
    for path in paths[1:]:
        other = mx.load(str(path))
        same = set(other) == set(first)
        out[str(path)] = same and all(mx.array_equal(first[k], other[k]).item() for k in first)
    return out


def sweep(dump: Path | None = None) -> None:
    inputs = {T: _inputs(T) for T in sorted({T for T, _ in CASES})}
    order, first, bitwise, checks = [], {}, {}, {}
    for geometry in GEOMETRIES:
        _set(*geometry)
        for T, keep in CASES:

            def launch(T=T, keep=keep):
                return gd.gated_delta_conv_native(*inputs[T], (HK, DK, HV, DV), keep_states=keep)

            out = launch()
            mx.eval(out)
            key = (geometry[3:4], T, keep)  # L, where given: H and the rest change no bit
            if key in first:
                bitwise[f"{geometry} T{T} keep {keep}"] = all(
                    bool(mx.array_equal(a, b).item())
                    for a, b in zip(out, first[key], strict=True) if a is not None
                )  # fmt: skip
            else:
                first[key] = out
            profiled(launch, REPEATS)
            order.append([list(geometry), T, keep])
        checks[str(geometry)] = chain_check(gd.gated_delta_conv_native)
    if dump is not None:
        lanes = GEOMETRIES[0][3:4]  # the first geometry's outputs
        saved = {f"T{T} keep {keep} {i}": x for (L, T, keep), out in first.items()
                 if L == lanes for i, x in enumerate(out) if x is not None}  # fmt: skip
        mx.save_safetensors(str(dump), saved)
    print(json.dumps({"order": order, "bitwise_vs_first": bitwise, "checks": checks}))


def steps(ts: list[int]) -> None:
    """REPEATS steps of each T of the 27B-shape 4-bit model under the profiler (see above)."""
    from profile_step import _setup  # a sibling script: its warmed-up step

    from mtpcli import synthetic
    from mtpcli.models import qwen3_5 as tm

    if tm.gated_delta_conv is not gd.gated_delta_conv:
        raise SystemExit("the model does not run this gated-delta module")
    target, _ = synthetic.build("qwen3.8-27b", bits=4)
    if getattr(gd, "KNOCKOUT", False):  # see make_variants.py's KNOCKOUT_TAIL
        target.policy.choose = lambda key, batched, single, probe=True: batched()
    for T in ts:
        profiled(_setup(T, target=target), REPEATS)
    layers = sum(1 for layer in target.layers if layer.is_linear)
    print(json.dumps({"steps": ts, "launches_per_step": layers}))


def step_summary(meta: dict, us: list[float]) -> dict:
    """A ``--step`` profile's durations as ms a step by T: median, min, max, and each T's
    median over T = 1's."""
    per, ts = meta["launches_per_step"], meta["steps"]
    if len(us) != per * REPEATS * len(ts):
        raise SystemExit(f"{len(us)} kernels profiled, the plan has {per} x {REPEATS} x {len(ts)}")
    table = {}
    for i, T in enumerate(ts):
        block = us[i * per * REPEATS : (i + 1) * per * REPEATS]
        ms = [sum(block[j * per : (j + 1) * per]) / 1e3 for j in range(REPEATS)]
        table[f"T{T}"] = [statistics.median(ms), min(ms), max(ms)]
    if "T1" in table:
        for row in table.values():
            row.append(row[0] / table["T1"][0])
    print("| T | ms a step (median) | min | max | / T = 1 |")
    print("|---|---|---|---|---|")
    for T, row in table.items():
        print(f"| {T[1:]} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    return {"ms_median_min_max_ratio": table, "launches_per_step": per}


def summary(text: str) -> dict:
    """The profile (ncu's CSV followed by ``sweep``'s JSON line) as medians, min and max (us)
    by geometry and case; prints the table."""
    lines = text.splitlines()
    meta = next((json.loads(x) for x in reversed(lines) if x.startswith(('{"order"', '{"steps"'))),
                None)  # fmt: skip
    try:
        us = kernel_durations_us(text)
    except ValueError:
        us = None
    if meta is None or us is None:
        raise SystemExit("not a sweep's profile: no ncu CSV header or no launch order line")
    if "steps" in meta:
        return step_summary(meta, us)
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
    print("| W, R, MB, L, H | " + " | ".join(cases + [f"{c} / T1" for c in ratios]) + " |")
    print("|---" * (len(cases) + len(ratios) + 1) + "|")
    for geometry, row in table.items():
        cells = [f"{row[c][0]:.2f}" if c in row else "" for c in cases]
        cells += [f"{row[c][0] / row['T1'][0]:.3f}" for c in ratios]
        print(f"| {geometry} | " + " | ".join(cells) + " |")
    for geometry, check in meta.get("checks", {}).items():
        diffs = ", ".join(f"{k} {v:.3g}" for k, v in check["max_diff_vs_ops"].items())
        parity = "bitwise" if check["chain_bitwise"] else "BROKEN"
        print(f"{geometry}: T = 3 against 3 chained steps {parity}; max |kernel - ops| {diffs}")
    return {
        "us_median_min_max": table,
        "bitwise_vs_first": meta["bitwise_vs_first"],
        "checks": meta.get("checks", {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", default=None, help="the profile's CSV (with the JSON line)")
    ap.add_argument("--json", action="store_true", help="with --summary: the raw numbers too")
    ap.add_argument(
        "--step",
        type=int,
        nargs="+",
        default=None,
        help="profile REPEATS real steps of each T instead of the sweep",
    )
    ap.add_argument(
        "--module",
        type=Path,
        default=None,
        help="another version of mtpcli/kernels/gated_delta.py to run instead",
    )
    ap.add_argument(
        "--dump",
        type=Path,
        default=None,
        help="with the sweep: save the first geometry's outputs (safetensors)",
    )
    ap.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        default=None,
        help="FILE FILE ...: whether --dump outputs are bitwise the first file's",
    )
    ap.add_argument("--geometry", type=int, nargs="+", default=None, metavar="W R MB L [H]",
                    help="one geometry: the sweep's only one, or the steps' kernel")  # fmt: skip
    ap.add_argument("--with", dest="with_", nargs=argparse.REMAINDER, default=None,
                    help="W MB SCRIPT ARGS: run SCRIPT with that geometry")  # fmt: skip
    args = ap.parse_args()
    for path in [args.module, *(args.compare or [])]:
        if path is not None and not path.is_file():
            raise SystemExit(f"{path}: no such file")
    if args.dump is not None and args.dump.suffix != ".safetensors":
        raise SystemExit(f"--dump {args.dump}: name it *.safetensors (MLX would append it)")
    if args.module:
        use_module(args.module)
    if args.geometry and len(args.geometry) not in (4, 5):
        raise SystemExit(f"--geometry {args.geometry}: give W R MB L, and H if not 1")
    if args.geometry:
        GEOMETRIES[:] = [tuple(args.geometry)]
        _set(*args.geometry)
    if args.compare:
        print(json.dumps(compare(args.compare)))
    elif args.summary:
        out = summary(Path(args.summary).read_text())
        if args.json:
            print(json.dumps(out))
    elif args.with_:
        warps, min_blocks, *rest = args.with_
        _set(int(warps), None, int(min_blocks))
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")
    elif args.step:
        steps(args.step)
    else:
        sweep(args.dump)


if __name__ == "__main__":
    main()
