"""What one graph node costs the host on this machine, by kind: Python's build and MLX's
encoding (the ``mx.async_eval`` call), for chains of N nodes of one kind.

    python scripts/probe_node_cost.py --out DIR      # on the GPU (CUDA): kernels need it

Kinds: a view (reshape), an elementwise op (a launch MLX owns), a custom kernel with a short
source, the same kernel with a long source (MLX builds and hashes a kernel's whole source text
on every call and every evaluation), and both custom kernels inside ``mx.compile``.
Medians (min-max) of ``--n`` chains, microseconds a node.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

BODY = "unsigned int i = threadIdx.x + blockIdx.x * blockDim.x; out[i] = inp[i] + (T)1;"


def custom(pad: int):
    header = "// " + "x" * pad + "\n" if pad else ""
    k = mx.fast.cuda_kernel(name=f"probe_add_{pad}", input_names=["inp"], output_names=["out"],
                            source=BODY, header=header)  # fmt: skip
    return lambda x: k(inputs=[x], template=[("T", x.dtype)], grid=(x.size, 1, 1),
                       threadgroup=(min(x.size, 256), 1, 1), output_shapes=[x.shape],
                       output_dtypes=[x.dtype])[0]  # fmt: skip


def chains(nodes: int) -> dict:
    short, long = custom(0), custom(8000)
    shapes = [(1, 1, 5120), (1, 5120), (5120,)]

    def views(x):
        for i in range(nodes):
            x = x.reshape(shapes[i % 3])
        return x

    wide = mx.zeros((1, 1, 5120 + nodes), mx.bfloat16)
    mx.eval(wide)

    def slices(x):
        x = wide
        for _ in range(nodes):
            x = x[..., 1:]
        return x

    buf = mx.zeros((1, 4, 512, 256), mx.bfloat16)
    row = mx.ones((1, 4, 1, 256), mx.bfloat16)
    mx.eval(buf, row)

    def slice_updates(x):
        b = buf
        for i in range(nodes):
            b[..., i % 512 : i % 512 + 1, :] = row
        return b

    def elementwise(x):
        for _ in range(nodes):
            x = x + 1
        return x

    def chain_of(k, length=nodes):
        def run(x):
            for _ in range(length):
                x = k(x)
            return x

        return run

    def compiled_of(k, unit=8):
        f = mx.compile(chain_of(k, unit))

        def run(x):
            for _ in range(nodes // unit):
                x = f(x)
            return x

        return run

    return {
        "view (reshape)": views,
        "view (slice)": slices,
        "slice update (a KV row)": slice_updates,
        "elementwise (add)": elementwise,
        "custom kernel, 0.3 KB source": chain_of(short),
        "custom kernel, 8.3 KB source": chain_of(long),
        "compiled custom kernel, 0.3 KB": compiled_of(short),
        "compiled custom kernel, 8.3 KB": compiled_of(long),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=400)
    ap.add_argument("--n", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    x = mx.zeros((1, 1, 5120), mx.bfloat16)
    mx.eval(x)
    res = {"mlx": mx.__version__, "device": str(mx.default_device()), "nodes": args.nodes,
           "load_before": os.getloadavg(), "us_a_node": {}}  # fmt: skip
    for name, fn in chains(args.nodes).items():
        build, encode, wall = [], [], []
        for i in range(args.n + 2):
            mx.synchronize()
            t0 = time.perf_counter()
            y = fn(x)
            t1 = time.perf_counter()
            mx.async_eval(y)
            t2 = time.perf_counter()
            mx.eval(y)
            t3 = time.perf_counter()
            if i >= 2:
                build.append((t1 - t0) * 1e6 / args.nodes)
                encode.append((t2 - t1) * 1e6 / args.nodes)
                wall.append((t3 - t1) * 1e6 / args.nodes)
        res["us_a_node"][name] = {
            part: {"median": round(statistics.median(v), 2), "min": round(min(v), 2),
                   "max": round(max(v), 2)}
            for part, v in (("build", build), ("encode", encode), ("encode_to_result", wall))
        }  # fmt: skip
        r = res["us_a_node"][name]
        print(f"{name:32} build {r['build']['median']:6.2f}  encode {r['encode']['median']:6.2f}"
              f"  to result {r['encode_to_result']['median']:6.2f} us a node")  # fmt: skip
    res["load_after"] = os.getloadavg()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "node_cost.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
