"""Quantized matmul at M = 1..8 rows: our kernel against MLX's, per layer of the 27B shape.

    python scripts/bench_qmm.py --repeats 10 --out docs/benchmark_results

For each layer (random affine-quantized weights, bf16 activations) and M, the median time of
one product (``CALLS`` independent products per evaluation, divided), the weight bytes moved per
second, and whether every row of the M-row product is bitwise the one-row product. The device's
own read bandwidth (a large reduction) is measured in the same run, as the yardstick.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import mlx.core as mx

from mtpcli import kernels
from mtpcli.bench import timed_ms
from mtpcli.kernels import quantized_matmul as qm

LAYERS = {  # name: (K, N) of the Qwen3.8-27B shape
    "mlp up/gate 5120->17408": (5120, 17408),
    "mlp down 17408->5120": (17408, 5120),
    "gdn qkv 5120->10240": (5120, 10240),
    "attn/gdn out 6144->5120": (6144, 5120),
    "head 5120->248320": (5120, 248320),
}
CALLS = 32  # products per evaluation (4 for the head), so a sync is not what is timed


def device_read_bandwidth(repeats: int) -> dict:
    x = mx.ones((1 << 30) // 2, dtype=mx.bfloat16)  # 1 GiB
    mx.eval(x)
    t = timed_ms(lambda: mx.eval(x.sum()), repeats)
    return {"gb_s": x.nbytes / (t["median"] / 1e3) / 1e9, "ms": t}


def launch_floor(repeats: int) -> dict:
    """One tiny product (16 x 128): what a launch costs when the weights are nothing."""
    w, scales, biases = qm.random_quantized(16, 128, 64, 4, mx.bfloat16, seed=1)
    x = mx.random.normal((1, 128)).astype(mx.bfloat16)
    mx.eval(w, scales, biases, x)
    out = {}
    for name, fn in (("ours", qm.quantized_matmul_native), ("mlx", qm.quantized_matmul_ops)):
        t = timed_ms(lambda fn=fn: mx.eval([fn(x + i, w, scales, biases, group_size=64, bits=4)
                                            for i in range(CALLS)]), repeats)  # fmt: skip
        out[name] = t["median"] * 1e3 / CALLS
    t = timed_ms(lambda: mx.eval([x + i for i in range(CALLS)]), repeats)
    out["x + i alone"] = t["median"] * 1e3 / CALLS
    return out


def layer_costs(k: int, n: int, bits: int, gs: int, repeats: int) -> dict:
    w, scales, biases = qm.random_quantized(n, k, gs, bits, mx.bfloat16, seed=k + n)
    nbytes = w.nbytes + scales.nbytes + biases.nbytes
    calls = CALLS if n < 100_000 else 4
    xs = [mx.random.normal((8, k), key=mx.random.key(i)).astype(mx.bfloat16) for i in range(calls)]
    mx.eval(w, scales, biases, xs)
    kw = {"group_size": gs, "bits": bits}
    out: dict = {"weight_mib": nbytes / 2**20, "ours": {}, "mlx": {}, "rows_bitwise": {}}
    one = qm.quantized_matmul_native(xs[0][:1], w, scales, biases, **kw)
    for M in range(1, 9):
        for name, fn in (("ours", qm.quantized_matmul_native), ("mlx", qm.quantized_matmul_ops)):

            def run(fn=fn, M=M):
                mx.eval([fn(x[:M], w, scales, biases, **kw) for x in xs])

            t = timed_ms(run, repeats)
            us, lo, hi = (t[s] * 1e3 / calls for s in ("median", "min", "max"))
            out[name][M] = {"us": us, "gb_s": nbytes / (us / 1e6) / 1e9, "min_us": lo, "max_us": hi}
        # Row 0 of every M-row product against the one-row product, and all rows against M=8.
        full = qm.quantized_matmul_native(xs[0], w, scales, biases, **kw)
        part = qm.quantized_matmul_native(xs[0][:M], w, scales, biases, **kw)
        out["rows_bitwise"][M] = bool(
            mx.array_equal(part[:1], one).item() and mx.array_equal(part, full[:M]).item()
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if kernels.backend() == "cpu":
        raise SystemExit("needs a GPU backend (the kernel has no CPU variant)")
    load_before = os.getloadavg()
    res: dict = {
        "device": _device(), "backend": kernels.backend(), "mlx": mx.__version__,
        "python": platform.python_version(), "bits": args.bits, "group_size": args.group_size,
        "calls_per_eval": CALLS, "repeats": args.repeats,
    }  # fmt: skip
    t0 = time.time()
    res["device_read"] = device_read_bandwidth(args.repeats)
    print(f"device read {res['device_read']['gb_s']:.0f} GB/s", flush=True)
    res["launch_floor_us"] = launch_floor(args.repeats)
    print("launch floor us", res["launch_floor_us"], flush=True)
    res["layers"] = {}
    for name, (k, n) in LAYERS.items():
        res["layers"][name] = r = layer_costs(k, n, args.bits, args.group_size, args.repeats)
        print(name, {M: (round(r["ours"][M]["us"], 1), round(r["mlx"][M]["us"], 1),
                         r["rows_bitwise"][M]) for M in r["ours"]}, flush=True)  # fmt: skip
    res["seconds"] = time.time() - t0
    res["load_before"], res["load_after"] = load_before, os.getloadavg()
    if args.out:
        name = args.name or f"qmm_{args.bits}bit_g{args.group_size}"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))
        (args.out / f"{name}.md").write_text(markdown(res, args))
    print(markdown(res, args))


def markdown(res: dict, args) -> str:
    peak = res["device_read"]["gb_s"]
    lines = [
        f"# Quantized matmul, {res['bits']}-bit group {res['group_size']}, M = 1..8 rows",
        "",
        f"`python scripts/bench_qmm.py --repeats {args.repeats} --bits {args.bits} "
        f"--group-size {args.group_size}` on {res['device']} ({res['backend']}), MLX "
        f"{res['mlx']}; load {res['load_before'][0]:.2f} before, {res['load_after'][0]:.2f} "
        f"after. Median of {res['repeats']} evaluations of {res['calls_per_eval']} independent "
        "products (4 for the head), divided; min-max in the JSON. Device read bandwidth, same "
        f"run (1 GiB reduction): {peak:.0f} GB/s. One tiny product (16 x 128, with the add "
        f"that makes its input) costs {res['launch_floor_us']['ours']:.1f} us ours, "
        f"{res['launch_floor_us']['mlx']:.1f} us MLX's, the add alone "
        f"{res['launch_floor_us']['x + i alone']:.1f} us: the floor under every row below.",
        "",
        "| layer | weights MiB | path | M=1 us | M=2 | M=3 | M=4 | M=8 | M=1 GB/s (% of read) "
        "| M=3 / M=1 | rows bitwise |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["layers"].items():
        for path in ("ours", "mlx"):
            d = r[path]
            bitwise = all(r["rows_bitwise"].values()) if path == "ours" else ""
            lines.append(
                f"| {name} | {r['weight_mib']:.0f} | {path} | "
                + " | ".join(f"{d[M]['us']:.1f}" for M in (1, 2, 3, 4, 8))
                + f" | {d[1]['gb_s']:.0f} ({100 * d[1]['gb_s'] / peak:.0f}%) | "
                f"{d[3]['us'] / d[1]['us']:.2f} | {bitwise} |"
            )
    return "\n".join(lines) + "\n"


def _device() -> str:
    try:
        import subprocess

        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip() or platform.machine()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return platform.machine()


if __name__ == "__main__":
    main()
