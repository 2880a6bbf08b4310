"""Quantized matmul at M = 1..8 rows: our kernel against MLX's, per layer of the 27B shape.

    python scripts/bench_qmm.py --repeats 10 --out docs/benchmark_results
    python scripts/bench_qmm.py --arms 8 4 mlx --ms 1 3 8   # our kernel with 8 and 4 warps
    python scripts/bench_qmm.py --arms 8 8x5 --ms 1 3       # 8 warps, and capped for 5 blocks
    python scripts/bench_qmm.py --step --arms 8ns 8x2ns --ms 8 16 32   # norm + swiglu, 4 tiles
    ncu --set full -k regex:mtp_qmm python scripts/bench_qmm.py --launches-only
    ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum \\
        -k "regex:mtp_qmm|bench_stream_read" python scripts/bench_qmm.py --launches-only \\
        --launch-repeats 3 --arms 8 8x5 > q.csv
    python scripts/bench_qmm.py --ncu-summary q.csv --launch-repeats 3 --arms 8 8x5

For each layer (random affine-quantized weights, bf16 activations) and M, the median time of
one product (``CALLS`` independent products per evaluation, divided), the weight bytes moved per
second, and whether every row of the M-row product is bitwise the one-row product. The device's
own read bandwidth is measured in the same run, as the yardstick: a streaming read kernel
(16-byte loads, enough blocks to fill the device) and, as before, a large reduction; the
faster of the two is the yardstick. An arm ``W`` is our kernel with W split-K warps per tile;
``mlx`` is ``mx.quantized_matmul``.
``--launches-only`` runs each arm once per layer at M = 1 and 3 (``--launch-repeats`` times)
between cuProfilerStart and Stop, for a profiler, with a streaming read of each layer's bytes
beside it: the most one launch that reads them reaches. ``--ncu-summary`` maps the profile
back to layers and arms. ``--step``
takes the products a decode step runs (fused, as the target runs them) instead of the layers.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import mlx.core as mx

from mtpcli import kernels
from mtpcli.bench import timed_ms
from mtpcli.kernels import qmm_kernel as qmk
from mtpcli.kernels import quantized_matmul as qm

LAYERS = {  # name: (K, N) of the Qwen3.8-27B shape
    "mlp up/gate 5120->17408": (5120, 17408),
    "mlp down 17408->5120": (17408, 5120),
    "gdn qkv 5120->10240": (5120, 10240),
    "attn/gdn out 6144->5120": (6144, 5120),
    "head 5120->248320": (5120, 248320),
}
# The products one decode step of the 27B shape runs, fused as the target fuses them, with how
# many a step runs (in the name): --step times these instead.
STEP_LAYERS = {
    "mlp gate+up 5120->34816 (64)": (5120, 34816),
    "mlp down 17408->5120 (64)": (17408, 5120),
    "gdn in 5120->16480 (48)": (5120, 16480),
    "out 6144->5120 (64)": (6144, 5120),
    "attn qkv 5120->14336 (16)": (5120, 14336),
    "head 5120->248320 (1)": (5120, 248320),
}
CALLS = 32  # products per evaluation (4 for the head), so a sync is not what is timed


_STREAM = """
    const size_t n = a_shape[0] / 4;
    const uint4* p = reinterpret_cast<const uint4*>(a);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    uint32_t acc = 0u;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 2 * stride) {
      const uint4 u = p[i];
      const uint4 v = i + stride < n ? p[i + stride] : make_uint4(0u, 0u, 0u, 0u);
      acc ^= u.x ^ u.y ^ u.z ^ u.w ^ v.x ^ v.y ^ v.z ^ v.w;
    }
    out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = acc;
"""


def _stream_read(a: mx.array):
    """The streaming read of ``a`` (uint32) as a function returning its (tiny) result."""
    threads = 256 * 132 * 8  # 8 blocks of 256 per SM of an H200 (any GPU: enough to fill it)
    kernel = mx.fast.cuda_kernel(
        name="bench_stream_read", input_names=["a"], output_names=["out"], source=_STREAM
    )
    return lambda: kernel(inputs=[a], grid=(threads, 1, 1), threadgroup=(256, 1, 1),
                          output_shapes=[(threads,)], output_dtypes=[mx.uint32])[0]  # fmt: skip


def device_read_bandwidth(repeats: int) -> dict:
    """GB/s of a 1 GiB read: a streaming kernel of 16-byte loads, and a reduction (bf16 sum)."""
    a = mx.ones((1 << 30) // 4, dtype=mx.uint32)  # 1 GiB
    x = a.view(mx.bfloat16)
    mx.eval(a)
    stream = _stream_read(a)
    out = {}
    for name, fn in (("stream", stream), ("reduction", lambda: x.sum())):
        t = timed_ms(lambda fn=fn: mx.eval(fn()), repeats)
        out[name] = {"gb_s": a.nbytes / (t["median"] / 1e3) / 1e9, "ms": t}
    out["gb_s"] = max(out["stream"]["gb_s"], out["reduction"]["gb_s"])
    return out


def arms(names: list[str]) -> dict:
    """``W`` -> our kernel with W split-K warps; ``WxB`` -> the same with launch bounds that
    fit B blocks on a multiprocessor (ptxas caps its registers); a trailing ``ns`` -> its
    norm + swiglu variant (an MLP's gate and up, the norm weight ones); ``mlx`` -> MLX's
    product."""
    out = {}
    for name in names:
        if name == "mlx":
            out[name] = qm.quantized_matmul_ops
            continue
        base = name.removesuffix("ns")
        warps, _, blocks = base.partition("x")
        fn = partial(qmk.launch, warps=int(warps), min_blocks=int(blocks) if blocks else None)
        out[name] = fn if base == name else partial(_norm_swiglu, fn)
    return out


def _norm_swiglu(fn, x, w, scales, biases, **kw):
    return fn(x, w, scales, biases, norm_weight=mx.ones((x.shape[-1],), x.dtype), swiglu=True,
              **kw)  # fmt: skip


def launch_floor(repeats: int, fns: dict) -> dict:
    """One tiny product (16 x 128): what a launch costs when the weights are nothing."""
    w, scales, biases = qm.random_quantized(16, 128, 64, 4, mx.bfloat16, seed=1)
    x = mx.random.normal((1, 128)).astype(mx.bfloat16)
    mx.eval(w, scales, biases, x)
    out = {}
    for name, fn in fns.items():
        t = timed_ms(lambda fn=fn: mx.eval([fn(x + i, w, scales, biases, group_size=64, bits=4)
                                            for i in range(CALLS)]), repeats)  # fmt: skip
        out[name] = t["median"] * 1e3 / CALLS
    t = timed_ms(lambda: mx.eval([x + i for i in range(CALLS)]), repeats)
    out["x + i alone"] = t["median"] * 1e3 / CALLS
    return out


def _weights(k: int, n: int, bits: int, gs: int, rows: int = 8):
    w, scales, biases = qm.random_quantized(n, k, gs, bits, mx.bfloat16, seed=k + n)
    calls = CALLS if n < 100_000 else 4
    xs = [mx.random.normal((rows, k), key=mx.random.key(i)).astype(mx.bfloat16)
          for i in range(calls)]  # fmt: skip
    mx.eval(w, scales, biases, xs)
    return (w, scales, biases), xs


def layer_costs(
    k: int, n: int, bits: int, gs: int, repeats: int, fns: dict, ms: list, eager: bool
) -> dict:
    (w, scales, biases), xs = _weights(k, n, bits, gs, max(8, *ms))
    nbytes = w.nbytes + scales.nbytes + biases.nbytes
    kw = {"group_size": gs, "bits": bits}
    out: dict = {"weight_mib": nbytes / 2**20, "rows_bitwise": {}} | {name: {} for name in fns}
    for M in ms:
        for name, fn in fns.items():  # arms in turn for each M: a drift moves them alike

            def products(w, scales, biases, *xs, fn=fn, M=M):
                return [fn(x[:M], w, scales, biases, **kw) for x in xs]

            # Compiled, as decode steps run: the kernel call is built once, at tracing.
            run_products = products if eager else mx.compile(products)
            t = timed_ms(lambda f=run_products: mx.eval(f(w, scales, biases, *xs)), repeats)
            us, lo, hi = (t[s] * 1e3 / len(xs) for s in ("median", "min", "max"))
            out[name][M] = {"us": us, "gb_s": nbytes / (us / 1e6) / 1e9, "min_us": lo, "max_us": hi}
        # Every arm of ours: the M-row product's rows against the 8-row product's (its first
        # 8 past 8), and row 0 against the one-row product.
        out["rows_bitwise"][M] = {}
        c = min(M, 8)
        for name, fn in fns.items():
            if name != "mlx":
                one, full, part = (fn(xs[0][:m], w, scales, biases, **kw) for m in (1, 8, M))
                same = mx.array_equal(part[:1], one) & mx.array_equal(part[:c], full[:c])
                out["rows_bitwise"][M][name] = bool(same.item())
    return out


def _stream_bytes(nbytes: int) -> mx.array:
    """A uint32 array of at least ``nbytes`` (whole 16-byte loads) for the streaming read."""
    return mx.ones((-(-nbytes // 16) * 4,), dtype=mx.uint32)


GIB = ("stream 1 GiB",)


def plan(arms: list[str], layers: dict, ms=(1, 3)) -> list[tuple]:
    """What ``launches_only`` profiles, in order (the one order ``ncu_summary`` reads back):
    the 1 GiB read, then per layer a streaming read of its bytes (weights, scales, biases:
    what any one launch that reads the layer must move) and each of our arms at each M."""
    ours = [a for a in arms if a != "mlx"]  # MLX's product is not in the profiler's filter
    out = [GIB]
    for name in layers:
        out += [(name, "read")] + [(name, arm, M) for arm in ours for M in ms]
    return out


def _launches(fns: dict, bits: int, gs: int, layers: dict) -> Iterator[tuple]:
    """(what, fn) for each entry of ``plan``, a layer's weights made when it is reached."""
    for what in plan(list(fns), layers):
        if what == GIB:
            yield what, _stream_read(mx.ones((1 << 30) // 4, dtype=mx.uint32))
        elif what[1] == "read":
            (w, scales, biases), xs = _weights(*layers[what[0]], bits, gs)
            nbytes = w.nbytes + scales.nbytes + biases.nbytes
            yield what, _stream_read(_stream_bytes(nbytes))
        else:
            x = xs[0][: what[2]]
            mx.eval(x)
            yield what, partial(fns[what[1]], x, w, scales, biases, group_size=gs, bits=bits)


def profiled(fn, repeats: int) -> None:
    """``fn`` run ``repeats`` times between cuProfilerStart and Stop (for ``ncu
    --profile-from-start off``), once the queue before it has drained."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    mx.synchronize()
    cuda.cuProfilerStart()
    for _ in range(repeats):
        mx.eval(fn())
    mx.synchronize()
    cuda.cuProfilerStop()


def launches_only(fns: dict, bits: int, gs: int, layers: dict, repeats: int = 1) -> None:
    """Each launch of ``plan`` run once to compile, then ``repeats`` times between
    cuProfilerStart and Stop (for ``ncu --profile-from-start off``): only those are profiled."""
    for what, fn in _launches(fns, bits, gs, layers):
        mx.eval(fn())
        profiled(fn, repeats)
        print(f"{what}: {repeats} launches", flush=True)


def kernel_durations_us(csv_text: str) -> list[float]:
    """Each profiled kernel's ``gpu__time_duration.sum`` in us, in the profile's order, from
    ``ncu --csv`` output (which prints its own log lines before the CSV)."""
    lines = csv_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV header ("ID", ...) in the profile')
    unit = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    return [float(r["Metric Value"].replace(",", "")) * unit[r["Metric Unit"]]
            for r in csv.DictReader(lines[start:])
            if r.get("Metric Name") == "gpu__time_duration.sum"]  # fmt: skip


def ncu_summary(
    csv_text: str,
    arms: list[str],
    layers: dict,
    repeats: int,
    bits: int = 4,
    gs: int = 64,
    ms=(1, 3),
) -> dict:
    """Kernel durations (``ncu --csv --metrics gpu__time_duration.sum``, kernels
    ``regex:mtp_qmm|bench_stream_read``) of a ``launches_only`` run, mapped back to its
    ``plan``: median us of each launch's repeats, and GB/s. The plan's order is the CSV's; a
    count that differs is an error, not a guess. Other metrics in the same profile (occupancy,
    DRAM %) are left out: a kernel's duration is its one ``gpu__time_duration.sum`` row."""
    us = kernel_durations_us(csv_text)
    ours = [a for a in arms if a != "mlx"]
    order = plan(arms, layers, ms)
    if len(us) != len(order) * repeats:
        raise ValueError(f"{len(us)} kernels profiled, the plan has {len(order)} x {repeats}")
    med = {what: statistics.median(us[i * repeats : (i + 1) * repeats])
           for i, what in enumerate(order)}  # fmt: skip
    big = (1 << 30) / (med[GIB] * 1e3)  # GB/s: bytes / ns
    out: dict = {"device_read_gb_s": big, "stream_1gib_us": med[GIB], "layers": {}}
    for name, (k, n) in layers.items():
        nbytes = layer_bytes(k, n, bits, gs)
        read = med[(name, "read")]
        row = out["layers"][name] = {"bytes": nbytes, "read_us": read,
                                     "read_gb_s": nbytes / (read * 1e3)}  # fmt: skip
        for arm in ours:
            row[arm] = {M: med[(name, arm, M)] for M in ms}
    return out


def layer_bytes(k: int, n: int, bits: int = 4, gs: int = 64) -> int:
    """Bytes of an affine-quantized [N, K] weight with bf16 scales and biases."""
    return n * k * bits // 8 + 2 * 2 * n * (k // gs)


def ncu_markdown(s: dict, arms: list[str], ms=(1, 3)) -> str:
    """The table of ``ncu_summary``: each arm at M = 1 against the device's read (1 GiB) and
    against one streaming read of the same bytes (what a single launch can reach)."""
    ours = [a for a in arms if a != "mlx"]
    dev = s["device_read_gb_s"]
    lines = [
        f"Streaming read of 1 GiB: {s['stream_1gib_us']:.1f} us, {dev:.0f} GB/s (the device's "
        "read bandwidth).",
        "",
        "| layer | MB | read of these bytes, us (GB/s, % of device) | arm | M=1 us | M=1 GB/s "
        "| % of device | % of the same-size read | M=3 / M=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in s["layers"].items():
        read = f"{r['read_us']:.1f} ({r['read_gb_s']:.0f}, {100 * r['read_gb_s'] / dev:.0f}%)"
        for arm in ours:
            one = r[arm][ms[0]]
            gbs = r["bytes"] / (one * 1e3)
            ratio = f"{r[arm][3] / one:.2f}" if 3 in r[arm] else ""
            lines.append(f"| {name} | {r['bytes'] / 1e6:.1f} | {read} | {arm} | {one:.1f} | "
                         f"{gbs:.0f} | {100 * gbs / dev:.0f}% | {100 * r['read_us'] / one:.0f}% | "
                         f"{ratio} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--arms", nargs="+", default=[str(qmk.WARPS), "mlx"],
                    help="W (ours, W warps), WxB (launch bounds for B blocks), mlx")  # fmt: skip
    ap.add_argument("--ms", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--launches-only", action="store_true")
    ap.add_argument("--step", action="store_true", help="a decode step's fused products")
    ap.add_argument("--eager", action="store_true", help="time products op by op, not compiled")
    ap.add_argument("--launch-repeats", type=int, default=1,
                    help="with --launches-only: profiled launches of each")  # fmt: skip
    ap.add_argument("--ncu-summary", type=Path, default=None,
                    help="an ncu CSV of a --launches-only run (same --arms, --step, "
                    "--launch-repeats): print its table")  # fmt: skip
    args = ap.parse_args()
    layers = STEP_LAYERS if args.step else LAYERS
    if args.ncu_summary:
        try:
            s = ncu_summary(args.ncu_summary.read_text(), args.arms, layers,
                            args.launch_repeats, args.bits, args.group_size)  # fmt: skip
        except (OSError, ValueError) as e:  # a profile of another plan, or none: say which
            raise SystemExit(f"bench_qmm.py --ncu-summary {args.ncu_summary}: {e}") from None
        s |= {
            "arms": args.arms,
            "launch_repeats": args.launch_repeats,
            "profile": str(args.ncu_summary),
        }
        if args.out:
            name = args.name or f"qmm_ncu_{args.bits}bit_g{args.group_size}"
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.json").write_text(json.dumps(s, indent=1))
        print(ncu_markdown(s, args.arms))
        return
    if kernels.backend() != "cuda":
        raise SystemExit("needs the CUDA backend (the yardstick kernel is CUDA)")
    fns = arms(args.arms)
    if args.launches_only:
        launches_only(fns, args.bits, args.group_size, layers, args.launch_repeats)
        return
    load_before = os.getloadavg()
    res: dict = {
        "device": _device(), "backend": kernels.backend(), "mlx": mx.__version__,
        "python": platform.python_version(), "bits": args.bits, "group_size": args.group_size,
        "calls_per_eval": CALLS, "repeats": args.repeats, "arms": args.arms,
        "compiled": not args.eager,
    }  # fmt: skip
    t0 = time.time()
    res["device_read"] = device_read_bandwidth(args.repeats)
    print("device read GB/s", {k: round(v["gb_s"]) for k, v in res["device_read"].items()
                                if isinstance(v, dict)}, flush=True)  # fmt: skip
    res["launch_floor_us"] = launch_floor(args.repeats, fns)
    print("launch floor us", res["launch_floor_us"], flush=True)
    res["layers"] = {}
    for name, (k, n) in layers.items():
        res["layers"][name] = r = layer_costs(
            k, n, args.bits, args.group_size, args.repeats, fns, args.ms, args.eager
        )
        print(name, {M: [round(r[a][M]["us"], 1) for a in fns] for M in args.ms}, flush=True)
    res["seconds"] = time.time() - t0
    res["load_before"], res["load_after"] = load_before, os.getloadavg()
    if args.out:
        name = args.name or f"qmm_{args.bits}bit_g{args.group_size}"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))
        (args.out / f"{name}.md").write_text(markdown(res, args))
    print(markdown(res, args))


def markdown(res: dict, args) -> str:
    read = res["device_read"]
    peak = read["gb_s"]
    ms = [M for M in (1, 2, 3, 4, 8) if M in args.ms]
    floor = ", ".join(f"{a} {us:.1f} us" for a, us in res["launch_floor_us"].items())
    lines = [
        f"# Quantized matmul, {res['bits']}-bit group {res['group_size']}, M = 1..8 rows",
        "",
        f"`python scripts/bench_qmm.py --repeats {args.repeats} --bits {args.bits} "
        f"--group-size {args.group_size} --arms {' '.join(args.arms)}"
        f"{' --step' if args.step else ''}"
        f"{' --eager' if args.eager else ''}` on {res['device']} "
        f"({res['backend']}), MLX {res['mlx']}; load {res['load_before'][0]:.2f} before, "
        f"{res['load_after'][0]:.2f} after. Median of {res['repeats']} evaluations of "
        f"{res['calls_per_eval']} independent products (4 for the head), "
        f"{'op by op' if args.eager else 'one compiled call'}, divided; min-max in "
        f"the JSON. Arms `W`: our kernel, W warps (`WxB`: launch bounds for B blocks). "
        f"Device read bandwidth, same run, 1 GiB: "
        f"{read['stream']['gb_s']:.0f} GB/s streaming kernel, "
        f"{read['reduction']['gb_s']:.0f} GB/s reduction; the % column is of {peak:.0f}. One "
        f"tiny product (16 x 128, with the add that makes its input): {floor}.",
        "",
        "| layer | weights MiB | arm | "
        + " | ".join(f"M={M} us" for M in ms)
        + " | M=1 GB/s (% of read) | M=3 / M=1 | rows bitwise |",
        "|---|---|---|" + "---|" * (len(ms) + 3),
    ]
    for name, r in res["layers"].items():
        for arm in args.arms:
            d = r[arm]
            bitwise = "" if arm == "mlx" else all(v[arm] for v in r["rows_bitwise"].values())
            ratio = f"{d[3]['us'] / d[1]['us']:.2f}" if 1 in d and 3 in d else ""
            gbs = f"{d[1]['gb_s']:.0f} ({100 * d[1]['gb_s'] / peak:.0f}%)" if 1 in d else ""
            lines.append(
                f"| {name} | {r['weight_mib']:.0f} | {arm} | "
                + " | ".join(f"{d[M]['us']:.1f}" for M in ms)
                + f" | {gbs} | {ratio} | {bitwise} |"
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
