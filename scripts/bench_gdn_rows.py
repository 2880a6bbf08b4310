"""The gated-delta kernel at each number of value rows per warp, side by side.

    python scripts/bench_gdn_rows.py --rows 2 4 --repeats 25 --out DIR
    ncu --csv --metrics gpu__time_duration.sum -k regex:gated_delta \
        python scripts/bench_gdn_rows.py --launches-only
    git show REV:mtpcli/kernels/gated_delta.py > /tmp/gd_rev.py
    python scripts/bench_gdn_rows.py --rows 4 --baseline /tmp/gd_rev.py

``--baseline FILE [FILE ...]`` adds arms run by other versions of
``mtpcli/kernels/gated_delta.py`` (an earlier commit's, an experiment), named by their file
stems, side by side with this one in the same process: their kernel names differ with their
sources, so MLX compiles and caches each apart.

The whole gated-delta part (raw inputs: q/k normalisation, gates, recurrence, per-step states
when kept) of 48 independent layers of the 27B shape, bf16, as one ``mx.compile``d call, 8
passes back to back per sample, every arm once per repeat in turn (a drifting machine moves
all arms alike); ms per pass, median (min-max). Also whether each arm's final states equal the
first arm's bitwise. ``--launches-only`` launches each arm three times on one layer, for a
profiler's kernel durations (free of launch costs). Needs a GPU backend (CUDA here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtpcli.kernels import gated_delta as gd

B, HK, HV, DK, DV, LAYERS, CHAIN = 1, 16, 48, 128, 128, 48, 8


def _inputs(T: int, layers: int):
    mx.random.seed(T)
    q, k = (mx.random.normal((B, T, HK, DK)).astype(mx.bfloat16) for _ in range(2))
    v = mx.random.normal((B, T, HV, DV)).astype(mx.bfloat16)
    a, b = (mx.random.normal((B, T, HV)).astype(mx.bfloat16) for _ in range(2))
    states = [mx.random.normal((B, HV, DV, DK)) * 0.1 for _ in range(layers)]
    mx.eval(q, k, v, a, b, states)
    return (q, k, v, a, b), states


A_LOG, DT_BIAS = mx.zeros((HV,)), mx.ones((HV,), dtype=mx.bfloat16)


def _modules(paths: list[Path]) -> dict:
    """Ours and other versions of the gated-delta module imported beside it, by arm prefix."""
    modules = {"": gd}
    for path in paths:
        spec = importlib.util.spec_from_file_location(f"mtpcli.kernels._gd_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[f"{path.stem}_"] = module
    return modules


def _arm(mod, rows: int, keep: bool):
    def every_layer(q, k, v, a, b, *states):
        mod._ROWS = rows  # read while tracing: each arm's trace keeps its own launch shape
        outs = [mod.gated_delta_raw_native(q, k, v, a, b, A_LOG, DT_BIAS, s, keep_states=keep)
                for s in states]  # fmt: skip
        return [o[1] for o in outs], [x for o in outs for x in o if x is not None]

    return mx.compile(every_layer)


def side_by_side(rows: list[int], ts: list[int], repeats: int, modules: dict) -> dict:
    res: dict = {"ms_48_layers": {}, "final_states_equal_first_arm": {}}
    for T in ts:
        xs, states = _inputs(T, LAYERS)
        for keep in (False,) if T == 1 else (False, True):
            arms = {f"{p}rows_{r}": _arm(m, r, keep) for p, m in modules.items()
                    for r in rows}  # fmt: skip
            finals = {}
            for name, fn in arms.items():  # trace, warm up
                finals[name] = fn(*xs, *states)[0]
                for _ in range(3):
                    mx.eval(fn(*xs, *states))
            times: dict = {name: [] for name in arms}
            for _ in range(repeats):
                for name, fn in arms.items():
                    t0, s, kept = time.perf_counter(), states, []
                    for _ in range(CHAIN):
                        s, out = fn(*xs, *s)
                        kept += out
                    mx.eval(kept)
                    times[name].append((time.perf_counter() - t0) * 1e3 / CHAIN)
            key, first = f"T{T}_keep{int(keep)}", finals[f"rows_{rows[0]}"]
            res["ms_48_layers"][key] = {
                name: {"median": statistics.median(x), "min": min(x), "max": max(x)}
                for name, x in times.items()
            }  # fmt: skip
            res["final_states_equal_first_arm"][key] = {
                name: all(mx.array_equal(x, y).item() for x, y in zip(first, f, strict=True))
                for name, f in finals.items()
            }  # fmt: skip
            print(key, {n: round(v["median"], 3) for n, v in res["ms_48_layers"][key].items()},
                  flush=True)  # fmt: skip
    return res


def launches_only(rows: list[int], ts: list[int], modules: dict) -> None:
    for T in ts:
        xs, states = _inputs(T, 1)
        for prefix, mod in modules.items():
            for r in rows:
                mod._ROWS = r
                for keep in (False,) if T == 1 else (False, True):
                    for _ in range(3):
                        mx.eval(mod.gated_delta_raw_native(*xs, A_LOG, DT_BIAS, states[0],
                                                           keep_states=keep))  # fmt: skip
                    print(f"T={T} {prefix}rows={r} keep={keep}: 3 launches", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--launches-only", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--baseline",
        type=Path,
        nargs="+",
        default=[],
        help="other versions of mtpcli/kernels/gated_delta.py, run as extra arms",
    )
    args = ap.parse_args()
    for path in args.baseline:
        if not path.is_file():
            raise SystemExit(f"--baseline {path}: no such file")
    modules = _modules(args.baseline)
    if gd._kernel(False, raw=True) is None:
        raise SystemExit("needs a GPU backend with a native gated-delta kernel")
    if args.launches_only:
        launches_only(args.rows, args.ts, modules)
        return
    res = side_by_side(args.rows, args.ts, args.repeats, modules)
    res |= {"device": str(mx.device_info().get("device_name", "")), "mlx": mx.__version__,
            "repeats": args.repeats, "chain": CHAIN, "load_after": os.getloadavg(),
            "baseline": [str(p) for p in args.baseline]}  # fmt: skip
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gdn_rows.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
