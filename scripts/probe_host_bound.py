"""Is classic decoding host-bound here? Per token: the graph build, mx.async_eval's call, the wait.

    python scripts/probe_host_bound.py --runs 6 --out DIR              # the decode loop
    MLX_USE_CUDA_GRAPHS=0 python scripts/probe_host_bound.py --runs 6  # a setting: own process
    python scripts/probe_host_bound.py --op-costs --out DIR            # host cost a call
    python scripts/probe_host_bound.py --build --out DIR               # build and encode times
    python scripts/probe_host_bound.py --runs 8 --begin-norms-every-other  # the two-launch norm

The decode part runs our classic loop on a random-weight model of ``--shape`` (a fresh cache
and prompt each run), timing each token's three parts: building the next step's graph (Python
and MLX op construction), ``mx.async_eval``'s call (MLX encodes and submits the step), and the
wait in ``.item()`` for the token before it. A wait near zero while the call takes as long as
the step says the device finished before the host did: the loop is host-bound. Medians over
each run's tokens after the fourth, in ms; with ``--sync-every-other`` odd runs call
``mx.eval`` instead, and ``--clear-cache`` empties MLX's buffer cache before each run.

``--op-costs`` times chains of 400 dependent calls of one kind in one graph (build, then
evaluate; us a call, median of 7): MLX ops, MLX's quantized product, ours (on a GPU), and, on
CUDA, trivial custom kernels that read their inputs' shapes, constants or strides.

``--build`` times, apart, the pure build of a decode step, a verify block of 3 and two drafts,
and ``mx.async_eval``'s call on each with nothing queued before it: MLX's encoding without any
wait for earlier work (in the real loop the same call can also wait, ``scheduler`` back-pressure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mtpcli import kernels, synthetic
from mtpcli.engine import prompt_array
from mtpcli.engine.sampling import SamplingParams, pick
from mtpcli.kernels import quantized_matmul as qm

CHAIN = 400


def decode_run(target, prompt: list[int], tokens: int, sync: bool) -> dict:
    """One run of the classic loop, its tokens' parts timed (ms, medians after the fourth)."""
    cache = target.make_cache()
    hidden = target.prefill(prompt_array(prompt), cache)
    y = pick(target.lm_head(hidden[:, -1:])[0, -1], SamplingParams())
    mx.eval(y)
    parts: dict[str, list[float]] = {"build": [], "submit": [], "wait": [], "token": []}
    for _ in range(tokens):
        t0 = time.perf_counter()
        out = target.forward(y.reshape(1, 1), cache)
        y_next = pick(target.lm_head(out.hidden)[0, -1], SamplingParams())
        t1 = time.perf_counter()
        (mx.eval if sync else mx.async_eval)(y_next)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            parts[name].append(dt * 1e3)
        y = y_next
    return {name: round(statistics.median(v[4:]), 3) for name, v in parts.items()} | {"sync": sync}


def chain_us(step: Callable[[mx.array], mx.array], x0: mx.array) -> dict:
    """Build and evaluate CHAIN dependent calls of ``step``: us a call, median of 7 graphs."""
    builds, evals = [], []
    for r in range(9):
        t0, x = time.perf_counter(), x0
        for _ in range(CHAIN):
            x = step(x)
        t1 = time.perf_counter()
        mx.eval(x)
        t2 = time.perf_counter()
        if r >= 2:  # the first graphs compile kernels
            builds.append((t1 - t0) * 1e6 / CHAIN)
            evals.append((t2 - t1) * 1e6 / CHAIN)
    return {"build": round(statistics.median(builds), 2),
            "eval": round(statistics.median(evals), 2)}  # fmt: skip


def op_costs() -> dict:
    x = mx.random.normal((1, 256)).astype(mx.bfloat16)
    w, s, b = qm.random_quantized(256, 256, 64, 4, mx.bfloat16, 1)
    norm = mx.ones((256,), mx.bfloat16)
    mx.eval(x, w, s, b, norm)
    steps = {
        "add": lambda v: v + 1,
        "rms_norm": lambda v: mx.fast.rms_norm(v, norm, 1e-6),
        "mlx_qmm": lambda v: mx.quantized_matmul(v, w, s, b, group_size=64, bits=4),
    }
    if qm._kernel(qm.PLAIN) is not None:
        steps["our_qmm"] = lambda v: qm.quantized_matmul_native(v, w, s, b, group_size=64, bits=4)
    res = {name: chain_us(step, x) for name, step in steps.items()}
    if kernels.available("cuda"):
        res |= custom_kernel_costs()
    return res


def custom_kernel_costs() -> dict:
    """Trivial CUDA kernels: 1 or 4 inputs, reading *_shape, constants or strides."""
    x, w, s, b = mx.zeros((1, 32)), mx.zeros((32, 32)), mx.zeros((32,)), mx.zeros((32,))
    mx.eval(x, w, s, b)
    bodies = {
        "1in_shape": (["x"], "if (i < x_shape[1]) y[i] = x[i] + 1.0f;"),
        "1in_const": (["x"], "if (i < 32) y[i] = x[i] + 1.0f;"),
        "4in_shape": (["x", "w", "s", "b"],
                      "if (i < x_shape[1] && i < w_shape[0]) y[i] = x[i] + w[i] + s[i] + b[i];"),
        "4in_const": (["x", "w", "s", "b"], "if (i < 32) y[i] = x[i] + w[i] + s[i] + b[i];"),
        "4in_strides": (["x", "w", "s", "b"],
                        "if (i < 32) y[i] = x[i * x_strides[1]] + w[i] + s[i] + b[i];"),
    }  # fmt: skip
    given = {"x": x, "w": w, "s": s, "b": b}
    res = {}
    for name, (inputs, body) in bodies.items():
        source = "const int i = threadIdx.x;\n" + body
        kernel = mx.fast.cuda_kernel(
            name=kernels.kernel_name(f"probe_{name}", source),
            input_names=inputs,
            output_names=["y"],
            source=source,
        )

        def step(v, kernel=kernel, inputs=inputs):
            args = [v if n == "x" else given[n] for n in inputs]
            return kernel(inputs=args, grid=(32, 1, 1), threadgroup=(32, 1, 1),
                          output_shapes=[v.shape], output_dtypes=[v.dtype])[0]  # fmt: skip

        res[f"custom_{name}"] = chain_us(step, x)
    return res


def build_costs(target, drafter, prompt: list[int], n: int = 30) -> dict:
    """The host's pure build time (no evaluation inside: verify blocks unsubmitted) and
    ``mx.async_eval``'s call on an idle queue (MLX's encoding and submission alone) of a decode
    step, a 3-token verify block (with its exact head and the rollback of two of its positions) and
    two chained drafts, ms, median of ``n`` after warm-up; and a cProfile of the verify builds
    (the top functions by own time, in ms a block)."""
    from mtpcli.engine.mtp import draft
    from mtpcli.models.qwen3_5 import cache_arrays, rollback

    target.submit_every = 0
    greedy = SamplingParams()
    cache, dcache = target.make_cache(), drafter.make_cache()
    hidden = target.prefill(prompt_array(prompt), cache)
    tokens = mx.array(prompt[1:] + [5], mx.uint32)
    draft(drafter, target, tokens, hidden, dcache, 2, greedy)
    one, block = mx.array([[5]]), mx.array([[5, 6, 7]])

    def decode():
        return pick(target.lm_head(target.forward(one, cache).hidden)[0, -1], greedy)

    def verify():
        out = target.forward(block, cache, verify=True)
        logits = target.lm_head(out.hidden, exact=True)
        rollback(cache, out.traces, 1, 3)  # as a round that accepts no draft: one kept
        return [logits, *cache_arrays(cache)]

    def drafts():
        d, _ = draft(drafter, target, mx.array([5, 6, 7], mx.uint32), hidden[:, -3:], dcache,
                     2, greedy)  # fmt: skip
        drafter.trim(dcache, 4)  # back to where it was
        return d

    def timed(fn, profiler=None) -> tuple[float, float]:
        builds, submits = [], []
        for i in range(n + 4):
            if profiler:
                profiler.enable()
            t0 = time.perf_counter()
            out = fn()
            t1 = time.perf_counter()
            if profiler:
                profiler.disable()
            mx.async_eval(out)  # the queue is empty: the call is MLX's encoding alone
            t2 = time.perf_counter()
            mx.eval(out)
            if i >= 4:  # warm-up: the first block of each length runs op by op
                builds.append((t1 - t0) * 1e3)
                submits.append((t2 - t1) * 1e3)
        return round(statistics.median(builds), 3), round(statistics.median(submits), 3)

    parts = {"decode_step": timed(decode), "verify_block_3": timed(verify),
             "drafts_2": timed(drafts)}  # fmt: skip
    res = {"build_ms": {k: b for k, (b, _) in parts.items()},
           "submit_ms": {k: s for k, (_, s) in parts.items()}}  # fmt: skip
    import cProfile
    import pstats

    prof = cProfile.Profile()
    timed(verify, prof)
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]
    res["verify_profile_ms_a_block"] = [
        {"function": f"{Path(f).name}:{line}({name})", "calls": nc / (n + 4),
         "own": 1e3 * tt / (n + 4), "cumulative": 1e3 * ct / (n + 4)}
        for (f, line, name), (_, nc, tt, ct, _) in rows
    ]  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.8-27b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sync-every-other", action="store_true")
    ap.add_argument("--clear-cache", action="store_true")
    ap.add_argument(
        "--begin-norms-every-other",
        action="store_true",
        help="odd runs with quantized_matmul.BEGIN_NORMS on (the two-launch norm)",
    )
    ap.add_argument("--op-costs", action="store_true", help="only the host cost a call")
    ap.add_argument(
        "--build",
        action="store_true",
        help="only the host's build and encode times of a decode step, a verify, the drafts",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    res: dict = {"device": str(mx.device_info().get("device_name", mx.default_device())),
                 "mlx": mx.__version__, "load_before": os.getloadavg(),
                 "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")}}  # fmt: skip
    if args.op_costs:
        res["us_a_call"] = op_costs()
        print(json.dumps(res["us_a_call"], indent=1), flush=True)
    elif args.build:
        target, drafter = synthetic.build(args.shape, bits=args.bits)
        res |= build_costs(target, drafter, mx.random.randint(0, 1000, (64,)).tolist())
        print(json.dumps({"build_ms": res["build_ms"], "submit_ms": res["submit_ms"]}), flush=True)
        for row in res["verify_profile_ms_a_block"]:
            print(
                f"{row['own']:8.3f} {row['cumulative']:8.3f} {row['calls']:6.1f} {row['function']}"
            )
    else:
        target, _ = synthetic.build(args.shape, bits=args.bits)
        prompt = mx.random.randint(0, 1000, (64,)).tolist()
        decode_run(target, prompt, 16, sync=False)  # warm up: kernels, traces
        res["runs"] = []
        for i in range(args.runs):
            if args.clear_cache:
                mx.clear_cache()
            begin = args.begin_norms_every_other and i % 2 == 1
            if begin != qm.BEGIN_NORMS:
                qm.BEGIN_NORMS = begin
                kernels.changed()  # retrace the layer functions, outside the timed run
                decode_run(target, prompt, 8, sync=False)
            run = decode_run(target, prompt, args.tokens, args.sync_every_other and i % 2 == 1)
            run["begin_norms"] = begin
            res["runs"].append(run)
            print(json.dumps(run), flush=True)
    res["load_after"] = os.getloadavg()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "op_costs" if args.op_costs else "build" if args.build else "decode_parts"
        (args.out / f"host_bound_{name}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
