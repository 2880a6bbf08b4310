"""Time a quantized product of many rows three ways: MLX's quantized matmul, a plain matmul of
weights dequantized beforehand, and dequantize-then-matmul in one go (the candidate path for a
prompt's long chunks, docs/design.md "On the CPU").

    python scripts/bench_dequantized_products.py                        # the example's shapes
    python scripts/bench_dequantized_products.py --shapes 17408x5120 5120x17408 --rows 146 1024

Each figure is the median (min-max) over ``--repeats`` timings of ``--iters`` evaluations, after
two warm-ups; bf16 activations, 4-bit group-64 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx


def _time(fn, iters: int) -> float:
    mx.eval(fn())
    mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t) / iters * 1e3  # ms


def _arms(x, wq, s, b, wd) -> dict:
    """The three ways of x [M, K] times the 4-bit weights (``wd``: them dequantized)."""
    return {
        "quantized_matmul": lambda: mx.quantized_matmul(x, wq, s, b, group_size=64, bits=4),
        "matmul_predequantized": lambda: x @ wd.T,
        "dequantize_then_matmul": lambda: x @ mx.dequantize(wq, s, b, group_size=64, bits=4).T,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["384x128", "128x384", "1024x128"],
                    help="N x K weights")  # fmt: skip
    ap.add_argument("--rows", type=int, nargs="+", default=[512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not all(len(sh.split("x")) == 2 and all(p.isdigit() for p in sh.split("x"))
               for sh in args.shapes):  # fmt: skip
        ap.error("--shapes: each as N x K, e.g. 17408x5120")
    out = {"device": str(mx.default_device()), "load_before": os.getloadavg(), "results": []}
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        w = mx.random.normal((n, k), key=mx.random.key(0)).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        wd = mx.dequantize(wq, s, b, group_size=64, bits=4)  # [N, K] bf16
        mx.eval(wq, s, b, wd)
        for m in args.rows:
            x = mx.random.normal((m, k), key=mx.random.key(1)).astype(mx.bfloat16)  # [M, K]
            arms = _arms(x, wq, s, b, wd)
            row = {"shape": shape, "rows": m}
            for name, fn in arms.items():
                runs = [_time(fn, args.iters) for _ in range(args.repeats)]
                row[name] = {"median": statistics.median(runs), "min": min(runs), "max": max(runs)}
            out["results"].append(row)
            print(f"{shape} at {m} rows: " + ", ".join(
                f"{a} {row[a]['median']:.3f} ms ({row[a]['min']:.3f}-{row[a]['max']:.3f})"
                for a in arms), flush=True)  # fmt: skip
    out["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
