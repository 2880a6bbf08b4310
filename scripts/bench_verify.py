"""Verify-cost table, per-op breakdown and classic decode speed on a random-weight model.

    python scripts/bench_verify.py --shape qwen3.8-27b --bits 4 --out docs/benchmark_results

Measures, on whatever device MLX runs on: the forward cost of T = 1, 2, 3, 4, 8 tokens after a
prompt through the verify path and the plain prefill path; a per-op breakdown (gated-delta
recurrence, attention, matmuls, rest); the gated-delta recurrence alone (our kernel against the
ops loop mlx-lm runs off Apple GPUs); which ops are row-invariant here; and classic decode tok/s,
ours against mlx-lm's generate_step, on the same weights in the same run. Medians over repeats,
with min-max. Writes <out>/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from mtpcli import synthetic
from mtpcli.bench import forward_cost
from mtpcli.bench import timed_ms as timed
from mtpcli.engine.classic import generate_classic
from mtpcli.kernels import conv_window as cw
from mtpcli.kernels import gated_delta as gd
from mtpcli.models import qwen3_5 as tm
from mtpcli.models.quantized_layers import stock_layers
from mtpcli.options import QMM_CHOICES, Options

TS = (1, 2, 3, 4, 8)


def mlx_lm_forward_cost(target, prompt: mx.array, T: int, repeats: int) -> dict:
    """mlx-lm's own forward of T tokens (its caches, its gated-delta path), same weights."""
    cache = target.model.make_cache()
    with stock_layers(target.model):
        target.model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    x = mx.random.randint(0, 1000, (1, T))
    saved = [(c.offset,) if hasattr(c, "offset") else (list(c.cache),) for c in cache]

    def run():
        with stock_layers(target.model):
            mx.eval(target.model(x, cache=cache))
        for c, (s,) in zip(cache, saved, strict=True):
            if hasattr(c, "offset"):
                c.offset = s
            else:
                c.cache = list(s)

    return timed(run, repeats)


def gated_delta_alone(
    T: int,
    native: bool,
    repeats: int,
    layers: int = 48,
    compiled: bool = False,
    keep: bool | None = None,
    chain: int = 1,
    conv: bool = False,
) -> dict:
    """The whole gated-delta part of a layer from its raw inputs (q/k normalisation, decay,
    beta, recurrence, per-step states when T > 1 unless ``keep`` says otherwise), over
    ``layers`` layers; with ``conv`` from the conv's inputs (the window convolution too, as
    the model runs it: one launch natively). Op by op, 48 small launches are bounded by the
    host; ``compiled`` builds them as one compiled call, as the model's compiled layer
    functions do, so the device time shows. ``chain`` passes run back to back (each from the
    last one's states) per timed sample, and the time is per pass: less host noise."""
    keep = T > 1 if keep is None else keep
    B, hk, hv, dk, dv = 1, 16, 48, 128, 128
    heads, nc = (hk, dk, hv, dv), 2 * hk * dk + hv * dv
    q = mx.random.normal((B, T, hk, dk)).astype(mx.bfloat16)
    k = mx.random.normal((B, T, hk, dk)).astype(mx.bfloat16)
    v = mx.random.normal((B, T, hv, dv)).astype(mx.bfloat16)
    qkv = mx.random.normal((B, T, nc)).astype(mx.bfloat16)  # [B, T, NC]: the conv's inputs
    conv_w = (mx.random.normal((nc, 4, 1)) * 0.5).astype(mx.bfloat16)
    a = mx.random.normal((B, T, hv)).astype(mx.bfloat16)
    b = mx.random.normal((B, T, hv)).astype(mx.bfloat16)
    A_log, dt_bias = mx.zeros((hv,)), mx.ones((hv,), dtype=mx.bfloat16)
    states = [mx.random.normal((B, hv, dv, dk)) * 0.1 for _ in range(layers)]
    # what each layer carries from pass to pass: its state, and with conv its window
    carried = [x for s in states for x in ((s, mx.zeros((B, 3, nc), mx.bfloat16)) if conv
                                           else (s,))]  # fmt: skip
    mx.eval(q, k, v, qkv, conv_w, a, b, carried)
    if native and gd.gated_delta_raw_native(q, k, v, a, b, A_log, dt_bias, states[0]) is None:
        return {}

    def ops(*args, keep_states):
        # mlx-lm's path off Apple GPUs: its gating ops, then the per-step ops loop
        qn, kn = normalize_qk(args[0], args[1], inv_scale=dk**-0.5, eps=1e-6)
        g, beta = compute_g(A_log, args[3], dt_bias), mx.sigmoid(args[4])
        return gd.gated_delta_ops(qn, kn, args[2], g, beta, args[7], keep_states=keep_states)

    def layer(q, k, v, qkv, a, b, s, window=None):
        """One layer: what it carries on, and all it outputs."""
        if conv:
            if native:
                out = gd.gated_delta_conv_native(qkv, window, conv_w, a, b, A_log, dt_bias, s,
                                                  heads, keep_states=keep)  # fmt: skip
            else:  # mlx-lm's convolution ops first
                out = gd.conv_then_delta(cw.conv_silu_ops, ops, qkv, window, conv_w, a, b,
                                          A_log, dt_bias, s, heads, keep)  # fmt: skip
            return (out[1], out[4]), [x for x in out if x is not None]
        fn = gd.gated_delta_raw_native if native else ops
        out = fn(q, k, v, a, b, A_log, dt_bias, s, keep_states=keep)
        return (out[1],), [x for x in out if x is not None]

    def every_layer(q, k, v, qkv, a, b, *flat):
        n = 2 if conv else 1
        outs = [layer(q, k, v, qkv, a, b, *flat[i : i + n]) for i in range(0, len(flat), n)]
        return [x for c, _ in outs for x in c], [x for _, o in outs for x in o]

    call = mx.compile(every_layer) if compiled else every_layer

    def run():
        c, kept = carried, []
        for _ in range(chain):
            c, out = call(q, k, v, qkv, a, b, *c)
            kept += out
        mx.eval(kept)

    res = timed(run, repeats)
    return {key: val / chain for key, val in res.items()} if chain > 1 else res


def leave_out(target, cache, T: int, repeats: int, what: str) -> dict:
    """Forward cost with one part replaced by a stub of the right shape (for differences)."""
    if what == "gated_delta":  # with its convolution, which the gated-delta kernel makes
        original, name = tm.gated_delta_conv, "gated_delta_conv"

        def stub(qkv, window, conv_w, a, b, A_log, dt_bias, state, heads, *, keep_states=False,
                 mode="auto"):  # fmt: skip
            B, T, _ = qkv.shape
            y = mx.zeros((B, T, heads[2], heads[3]), qkv.dtype)  # [B, T, Hv, Dv]
            kept = (T - 1, *state.shape)  # the state after each position but the last
            states = mx.broadcast_to(state, kept) if keep_states else None
            inputs = mx.concatenate([window, qkv], axis=1)  # [B, K-1+T, C]
            return y, state, states, inputs, inputs[:, T:]
    else:
        original, name = tm.attention_core, "attention_core"

        def stub(m, q, k, v, gate, mask, c, mode="auto"):
            B, L, Hkv, D = k.shape
            c.update_and_fetch(*(mx.zeros((B, Hkv, L, D), k.dtype),) * 2)
            return mx.zeros((B, L, q.shape[2] * D), q.dtype)

    setattr(tm, name, stub)
    target.retrace()  # traced with the stub
    try:
        return forward_cost(target, cache, T, True, repeats)
    finally:
        setattr(tm, name, original)
        target.retrace()


def matmul_costs(target, T: int, repeats: int, rowwise: bool) -> dict:
    """Every linear of one forward at M = T rows (batched, or one row at a time if ``rowwise``
    and the row policy found the layer not row-invariant here)."""
    policy = target.policy
    linears = [m for _, m in target.model.named_modules()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear))]  # fmt: skip
    x_by_dim = {}
    for m in linears:
        d = m.weight.shape[1] * (32 // m.bits if isinstance(m, nn.QuantizedLinear) else 1)
        x_by_dim.setdefault(d, mx.random.normal((1, T, d)).astype(mx.bfloat16))
    mx.eval(list(x_by_dim.values()))

    def run():
        outs = []
        for m in linears:
            d = m.weight.shape[1] * (32 // m.bits if isinstance(m, nn.QuantizedLinear) else 1)
            x = x_by_dim[d]
            key = (policy.signature(m), T, str(x.dtype))
            if rowwise and T > 1 and not policy.verdicts.get(key, False):
                outs.append(mx.concatenate([m(x[:, t : t + 1]) for t in range(T)], axis=1))
            else:
                outs.append(m(x))
        mx.eval(outs)

    return timed(run, repeats)


def row_invariance(bits) -> dict:
    """Are batched rows bitwise equal to single-row results here? (The exactness question.)"""
    out = {}
    lin = nn.Linear(5120, 17408, bias=False)
    lin.set_dtype(mx.bfloat16)
    layers = {"bf16 linear": lin, "4-bit linear": nn.QuantizedLinear.from_linear(lin, 64, 4),
              "8-bit linear": nn.QuantizedLinear.from_linear(lin, 64, 8)}  # fmt: skip
    x = mx.random.normal((1, 8, 5120)).astype(mx.bfloat16)
    for name, layer in layers.items():
        single = [layer(x[:, t : t + 1]) for t in range(8)]
        out[name] = {
            M: all(
                mx.array_equal(layer(x[:, :M])[:, t : t + 1], single[t]).item() for t in range(M)
            )
            for M in range(2, 9)
        }
    q = mx.random.normal((1, 24, 4, 256)).astype(mx.bfloat16)
    kv = mx.random.normal((1, 4, 68, 256)).astype(mx.bfloat16)
    full = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.06, mask="causal")
    per = [
        mx.fast.scaled_dot_product_attention(
            q[:, :, t : t + 1], kv[:, :, : 65 + t], kv[:, :, : 65 + t], scale=0.06
        )
        for t in range(4)
    ]
    out["sdpa causal T=4"] = mx.array_equal(full, mx.concatenate(per, axis=2)).item()
    return out


def eager(target):
    """``target`` (the same layers, fused products and row policy) run op by op."""
    return target.with_options(dataclasses.replace(target.options, compile=False))


def decode_arms(target) -> dict[str, tuple[Callable, Callable]]:
    """``classic_tps``'s arms: name -> (the setting held over its warm-up and repeats, a run
    that returns (tok/s, token intervals)). An arm of ours is a target on the same weights
    under other options (the kernel mode stays: the shared layers hold it)."""
    from mlx_lm.generate import generate_step

    unfused = tm.Qwen35Target(target.model, target.config, target.options, fuse=False)

    def rate(gen):
        """tok/s after the first token, and the token intervals' spread (ms): whether a slow
        run is slow throughout or stalls now and then."""
        next(gen)
        stamps = [time.perf_counter()]
        stamps += [time.perf_counter() for _ in gen]
        gaps = sorted((b - a) * 1e3 for a, b in itertools.pairwise(stamps))
        p50 = statistics.median(gaps)
        spread = {"p10": gaps[len(gaps) // 10], "p50": p50, "p90": gaps[len(gaps) * 9 // 10],
                  "max": gaps[-1], "over_1.5x_p50": sum(g > 1.5 * p50 for g in gaps)}  # fmt: skip
        return len(gaps) / (stamps[-1] - stamps[0]), spread

    def ours(t):
        return lambda prompt, n: rate(generate_classic(t, prompt, max_tokens=n))

    def mlx_lm(prompt, n):
        return rate(generate_step(mx.array(prompt), target.model, max_tokens=n))

    return {
        "ours": (nullcontext, ours(target)),
        "ours_no_gc": (_no_gc, ours(target)),
        "ours_eager": (nullcontext, ours(eager(target))),
        "ours_unfused": (nullcontext, ours(unfused)),
        "ours_mlx_qmm": (lambda: stock_layers(target.model), ours(unfused)),
        "ours_mlx_qmm_eager": (lambda: stock_layers(target.model),
                               ours(eager(unfused))),
        "mlx_lm": (lambda: stock_layers(target.model), mlx_lm),
    }  # fmt: skip


def classic_tps(target, prompt, n: int, repeats: int, names: list[str] | None = None) -> dict:
    """Classic decode tok/s on the same weights, each of ``decode_arms`` (``names``: a
    subset): ours as loaded and with one of its parts switched, ours on MLX's own quantized
    matmul, and mlx-lm's generate_step, with each run's token intervals (``token_ms``).
    Interleaved: each repeat runs every arm once, after one untimed run under its setting (a
    setting's switch retraces), so a drift of the machine moves all arms alike."""
    arms = {k: v for k, v in decode_arms(target).items() if names is None or k in names}
    if names is not None and len(arms) < len(names):
        raise SystemExit(f"unknown arms: {sorted(set(names) - set(arms))}")
    vals: dict[str, list[float]] = {name: [] for name in arms}
    spreads: dict[str, list[dict]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, (setting, fn) in arms.items():
            with setting():
                fn(prompt, n)  # warm-up (kernel compilation, tracing)
                tps, spread = fn(prompt, n)
                vals[name].append(tps)
                spreads[name].append(spread)
    res = {}
    for name, v in vals.items():
        res[name] = {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v,
                     "token_ms": spreads[name]}  # fmt: skip
        print(f"  {name}: {res[name]['median']:.2f} tok/s", flush=True)
    return res


@contextmanager
def _no_gc() -> Iterator[None]:
    """Python's garbage collector off over the runs (a host pause shows in a host-bound step)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def graph_build_ms(target, cache, repeats: int, T: int = 1) -> dict:
    """CPU time to build one decode step's graph (T = 1) or one verify block's (Python and MLX
    op construction, no eval), after a warm-up that traces and settles the row policy."""
    tok = mx.array([list(range(7, 7 + T))])
    vals = []
    for i in range(repeats + 4):
        t0 = time.perf_counter()
        out = target.forward(tok, cache, verify=T > 1)
        if i >= 4:
            vals.append((time.perf_counter() - t0) * 1e3)
        mx.eval(out.hidden)
        for c in cache:
            if hasattr(c, "offset"):
                c.offset -= T
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3.8-27b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--bits", type=int, default=4, help="4, 8, or 16 (bf16)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-repeats", type=int, default=3, help="decode runs an arm")
    ap.add_argument("--arms", nargs="+", default=None, help="decode arms to run (default all)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--quick", action="store_true", help="skip the breakdown and decode runs")
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="only the classic-decode arms (e.g. to compare MLX_* settings)",
    )
    ap.add_argument(
        "--gdn-only",
        action="store_true",
        help="only the gated-delta part of 48 layers, ours against mlx-lm's ops (no model)",
    )
    ap.add_argument(
        "--qmm",
        default="auto",
        choices=QMM_CHOICES,
        help="the target's quantized matmul (the decode arms cover MLX's as well)",
    )
    args = ap.parse_args()
    options = Options(qmm=args.qmm)

    load_before = os.getloadavg()

    def save(res: dict) -> None:
        # Written after each section, so a run cut short by a time limit still leaves its data.
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            name = args.name or f"verify_{args.shape}_{args.bits}bit"
            (args.out / f"{name}.partial.json").write_text(json.dumps(res, indent=1, default=str))

    if args.gdn_only:
        r = args.repeats
        gated_delta_alone(1, True, r, compiled=True, chain=8)  # the GPU's clocks up first
        res = {T: {"ours": gated_delta_alone(T, True, r),
                   "ours_compiled": gated_delta_alone(T, True, r, compiled=True),
                   "ours_compiled_x8": gated_delta_alone(T, True, r, compiled=True, chain=8),
                   "ours_compiled_x8_no_states": gated_delta_alone(
                       T, True, r, compiled=True, keep=False, chain=8),
                   "ours_compiled_x8_one_layer": gated_delta_alone(
                       T, True, r, layers=1, compiled=True, chain=8),
                   "ours_conv_compiled_x8": gated_delta_alone(
                       T, True, r, compiled=True, chain=8, conv=True),
                   "mlx_lm_ops": gated_delta_alone(T, False, r),
                   "mlx_lm_ops_with_conv": gated_delta_alone(T, False, r, conv=True)}
               for T in TS}  # fmt: skip
        res = {"device": _device(), "mlx": mx.__version__, "gated_delta_48_layers_ms": res,
               "load_before": load_before, "load_after": os.getloadavg()}  # fmt: skip
        print(json.dumps(res, indent=1, default=str))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{args.name or 'gdn'}.json").write_text(json.dumps(res, indent=1))
        return
    t0 = time.time()
    bits = None if args.bits == 16 else args.bits
    target, _ = synthetic.build(args.shape, bits=bits, options=options)
    print(f"built {args.shape} {args.bits}-bit in {time.time() - t0:.1f}s", flush=True)
    prompt = mx.random.randint(0, 1000, (1, args.prompt_tokens))
    cache = target.make_cache()
    target.prefill(prompt, cache)
    mx.eval(tm.cache_arrays(cache))
    res: dict = {
        "device": _device(), "shape": args.shape, "bits": args.bits,
        "options": options.describe(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
        "prompt_tokens": args.prompt_tokens,
        "mlx": mx.__version__, "python": platform.python_version(),
    }  # fmt: skip
    if args.decode_only:
        res["classic_tps"] = classic_tps(
            target, prompt[0].tolist(), args.decode_tokens, args.decode_repeats, args.arms
        )
        res["load_before"], res["load_after"] = load_before, os.getloadavg()
        print(json.dumps(res, indent=1, default=str))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            name = args.name or f"decode_{args.shape}_{args.bits}bit"
            (args.out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
        return
    res["graph_build_ms"] = graph_build_ms(target, cache, args.repeats)
    res["verify_graph_build_ms"] = {3: graph_build_ms(target, cache, args.repeats, 3)}
    print("graph build", res["graph_build_ms"], res["verify_graph_build_ms"], flush=True)
    res["verify_ms"] = {T: forward_cost(target, cache, T, True, args.repeats) for T in TS}
    print("verify", {T: round(v["median"], 2) for T, v in res["verify_ms"].items()}, flush=True)
    res["prefill_ms"] = {T: forward_cost(target, cache, T, False, args.repeats) for T in TS}
    print("prefill", {T: round(v["median"], 2) for T, v in res["prefill_ms"].items()}, flush=True)
    res["ms"] = {T: v["median"] for T, v in res["verify_ms"].items()}
    res["mlx_lm_forward_ms"] = {T: mlx_lm_forward_cost(target, prompt, T, args.repeats) for T in TS}
    res["mlx_lm_ms"] = {T: v["median"] for T, v in res["mlx_lm_forward_ms"].items()}
    print("mlx-lm forward", {T: round(v, 2) for T, v in res["mlx_lm_ms"].items()}, flush=True)
    save(res)
    policy = target.policy
    res["row_policy"] = {_op_name(policy, key): ok for key, ok in policy.verdicts.items()}
    res["ratio"] = {T: res["ms"][T] / res["ms"][1] for T in TS}
    res["gated_delta_48_layers_ms"] = {
        "native": {T: gated_delta_alone(T, True, args.repeats) for T in TS},
        "ops": {T: gated_delta_alone(T, False, args.repeats) for T in TS},
    }
    print("gated delta", json.dumps(res["gated_delta_48_layers_ms"], default=str)[:400], flush=True)
    save(res)
    if not args.quick:
        res["row_invariance"] = row_invariance(bits)
        print("row invariance", res["row_invariance"], flush=True)
        res["breakdown_ms"] = {}
        # Op by op (not compiled): leaving a part out of a compiled layer function would time
        # a retrace, and fusion would blur the parts.
        op_by_op = eager(target)
        for T in (1, 3, 4):
            total = forward_cost(op_by_op, cache, T, True, args.repeats)["median"]
            no_gd = leave_out(op_by_op, cache, T, args.repeats, "gated_delta")["median"]
            no_attn = leave_out(op_by_op, cache, T, args.repeats, "attention")["median"]
            mm = matmul_costs(target, T, args.repeats, True)["median"]
            mm_batched = matmul_costs(target, T, args.repeats, False)["median"]
            res["breakdown_ms"][T] = {
                "total": total, "gated_delta": total - no_gd, "attention": total - no_attn,
                "matmuls": mm, "matmuls_if_batched": mm_batched,
                "rest": total - (total - no_gd) - (total - no_attn) - mm,
            }  # fmt: skip
        print("breakdown", json.dumps(res["breakdown_ms"])[:600], flush=True)
        save(res)
        ids = prompt[0].tolist()
        res["classic_tps"] = classic_tps(target, ids, args.decode_tokens, args.decode_repeats)
        res["mlx_lm_decode_ms"] = 1000 / res["classic_tps"]["mlx_lm"]["median"]
        print("classic tok/s", res["classic_tps"], flush=True)
    res["load_before"], res["load_after"] = load_before, os.getloadavg()
    if args.out:
        name = args.name or f"verify_{args.shape}_{args.bits}bit"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
        (args.out / f"{name}.md").write_text(_markdown(res, args))
    print(_markdown(res, args))


def _op_name(policy, key: tuple) -> str:
    sig, T, dtype = key
    part = ""
    if isinstance(sig, tuple):  # (layer signature, part)
        sig, part = sig[0], f" {sig[1]}"
    kind, bits, shapes = policy.op_class(sig)
    first = shapes[0][1] if shapes else ()
    return f"{kind}{part}{'' if bits is None else f'/{bits}bit'} {first} T={T} {dtype}"


def _device() -> str:
    if mx.default_device() == mx.cpu:
        return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        info = mx.device_info()
        return str(info.get("device_name", info))
    except Exception:  # noqa: BLE001 - informational only
        return "gpu"


def _breakdown_lines(breakdown: dict) -> list[str]:
    """The per-op breakdown's table, and a warning where its differences came out negative."""
    lines = ["", "Per-op breakdown of the verify path, op by op (not compiled; ms; gated delta and "
             "attention by leaving each out, which also drops the ops only it consumes, such as "
             "the gated-delta input projections; matmuls timed alone):", "",
             "| T | total | gated delta | attention | matmuls | matmuls if batched | rest |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for T, b in breakdown.items():
        lines.append(
            f"| {T} | {b['total']:.2f} | {b['gated_delta']:.2f} | {b['attention']:.2f} | "
            f"{b['matmuls']:.2f} | {b['matmuls_if_batched']:.2f} | {b['rest']:.2f} |"
        )
    if any(v < 0 for b in breakdown.values() for v in b.values()):
        lines += ["", "**Not a breakdown here:** some parts came out negative. Each "
                  "column is timed in its own runs, and where the host sets the pace (op by op, "
                  "a launch at a time) a part costs what building and launching it costs the "
                  "host, so the parts do not add up to the total. Take them from the GPU's "
                  "kernel times instead (`scripts/profile_step.py` under `ncu`)."]  # fmt: skip
    return lines


def _markdown(res: dict, args) -> str:
    def cell(d):
        return f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f})" if d else "-"

    lines = [
        f"# Verify cost: {res['shape']}, {res['bits']}-bit, random weights",
        "",
        f"Device: {res['device']}; MLX {res['mlx']}; {res['options']}; "
        f"load before/after "
        f"{tuple(round(x, 2) for x in res['load_before'])} / "
        f"{tuple(round(x, 2) for x in res['load_after'])}.",
        "",
        f"Command: `python scripts/bench_verify.py {shlex.join(sys.argv[1:])}`. Times in ms, "
        f"median (min-max) of {args.repeats}; "
        f"forward of T tokens after a {res['prompt_tokens']}-token prompt, LM head included.",
        "",
        "| T | verify path | plain prefill path | verify / T=1 | mlx-lm forward | "
        "gated-delta part x48 (gating + recurrence), ours | same, mlx-lm's ops off Apple GPUs |",
        "|---|---|---|---|---|---|---|",
    ]
    gdn = res["gated_delta_48_layers_ms"]
    for T in TS:
        lines.append(
            f"| {T} | {cell(res['verify_ms'][T])} | {cell(res['prefill_ms'][T])} | "
            f"{res['ratio'][T]:.2f} | {cell(res['mlx_lm_forward_ms'][T])} | "
            f"{cell(gdn['native'][T])} | {cell(gdn['ops'][T])} |"
        )
    if "verify_graph_build_ms" in res:  # absent from files of before it was measured
        lines += ["", f"Graph building on the host (Python and MLX op construction, no eval): "
                  f"{cell(res['graph_build_ms'])} ms a decode step, "
                  f"{cell(res['verify_graph_build_ms'][3])} ms a verify block of 3."]  # fmt: skip
    if "breakdown_ms" in res:
        lines += _breakdown_lines(res["breakdown_ms"])
        c = res["classic_tps"]
        labels = {"ours": f"ours as run (qmm {res['qmm']}, compiled layer functions)",
                  "ours_conv_ops": "same, the convolution as mlx-lm's four ops",
                  "ours_gate_folded": "same, the gated norm in the out projection's launch",
                  "ours_gated_norm_ops": "same, the gated norm as mlx-lm's two ops",
                  "ours_attention_ops": "same, attention as MLX's ops, a position at a time",
                  "ours_residual_apart": "same, the residual adds apart from the products",
                  "ours_norm_swiglu_apart": "same, the input norms and swiglu apart from the "
                  "products",
                  "ours_norm_apart": "same, the input norms apart from the products",
                  "ours_norm_begun": "same, each norm begun by the residual add before it "
                                     "and finished by the product after it",
                  "ours_swiglu_apart": "same, the MLP's swiglu apart from its product",
                  "ours_no_gc": "same, Python's garbage collector off",
                  "ours_eager": "same, not compiled (op by op)",
                  "ours_unfused": "ours, projections unfused",
                  "ours_mlx_qmm": "ours on MLX's quantized matmul (unfused)",
                  "ours_mlx_qmm_eager": "same, not compiled",
                  "mlx_lm": "mlx-lm generate_step"}  # fmt: skip
        lines += ["", f"Classic decode, {args.decode_tokens} tokens, median (min-max) of "
                  f"{args.decode_repeats}, arms interleaved, same "
                  f"weights, same run; graph build (CPU, no eval) "
                  f"{res['graph_build_ms']['median']:.2f} ms a decode step:", "",
                  "| arm | tok/s | vs mlx-lm |", "|---|---|---|"]  # fmt: skip
        for key, label in labels.items():
            if key not in c:  # an arm a file from before it existed lacks
                continue
            v = c[key]
            lines.append(f"| {label} | {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f}) | "
                         f"{v['median'] / c['mlx_lm']['median']:.2f}x |")  # fmt: skip
        lines += [
                  "", f"Row invariance here: {res['row_invariance']}",
                  "", f"Row policy verdicts (batched == one position at a time): "
                  f"{res['row_policy']}"]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
