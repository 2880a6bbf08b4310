"""What one launch costs inside a compiled graph, where the work itself is nothing.

    python scripts/bench_launch.py --out docs/benchmark_results

A trivial custom kernel (add one to 32 floats), ``mx.sort`` and ``mx.cumsum`` on the same 32
floats, each chained 1, 48 and 384 times in one ``mx.compile``d call: ms per call, median
(min-max) of 15, and us per launch. At one token per decode step most kernels of a layer do
little work, so this is the floor a step's launch count sets. Needs a GPU backend (CUDA here).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mtpcli import kernels
from mtpcli.bench import timed_ms

_SOURCE = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_shape[0]) y[i] = x[i] + 1.0f;
"""


def _custom() -> Callable[[mx.array], mx.array]:
    kernel = mx.fast.cuda_kernel(
        name=kernels.kernel_name("probe_add_one", _SOURCE),
        input_names=["x"],
        output_names=["y"],
        source=_SOURCE,
    )
    return lambda x: kernel(
        inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )[0]  # fmt: skip


def _chain(op: Callable[[mx.array], mx.array], n: int) -> Callable[[mx.array], mx.array]:
    def f(x: mx.array) -> mx.array:
        for _ in range(n):
            x = op(x)
        return x

    return mx.compile(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not kernels.available("cuda"):
        raise SystemExit("needs MLX's CUDA backend")
    x = mx.zeros((32,))
    mx.eval(x)
    ops = {"custom_kernel": _custom(), "mx_sort": mx.sort, "mx_cumsum": mx.cumsum}
    res: dict = {"load_before": os.getloadavg()}
    for name, op in ops.items():
        for n in (1, 48, 384):
            f = _chain(op, n)
            r = timed_ms(lambda f=f: mx.eval(f(x)), args.repeats)
            res[f"{name}_x{n}"] = r
            print(f"{name} x{n}: {r['median']:.3f} ms, {r['median'] / n * 1000:.2f} us/launch")
    res["load_after"] = os.getloadavg()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "launch_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
