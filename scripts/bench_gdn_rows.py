"""The gated-delta kernel at each number of value rows per warp, side by side.

    python scripts/bench_gdn_rows.py --rows 1 2 4 8 [--one-reduction] --repeats 25 --out DIR
    ncu --csv --metrics gpu__time_duration.sum -k regex:gated_delta \
        python scripts/bench_gdn_rows.py --launches-only

The whole gated-delta part (raw inputs: q/k normalisation, gates, recurrence, per-step states
when kept) of 48 independent layers of the 27B shape, bf16, as one ``mx.compile``d call, 8
passes back to back per sample, every arm once per repeat in turn (a drifting machine moves
all arms alike); ms per pass, median (min-max). Also whether each arm's final states equal the
first arm's bitwise. ``--launches-only`` launches each arm three times on one layer, for a
profiler's kernel durations (free of launch costs). Needs a GPU backend (CUDA here).

``--one-reduction`` adds an experimental arm (CUDA only, not in the product): per step one
butterfly instead of two. With s the decayed state row, o = (s + delta k) . q is computed as
s . q + delta (k . q), so s . k, s . q and k . q are reduced together and the output no longer
waits for the state update. It rounds differently from the product (not bitwise equal); the
arm reports its largest difference and whether it keeps chain parity.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtpcli.kernels import gated_delta as gd
from mtpcli.kernels import kernel_name

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


_TWO_REDUCTIONS_END = "o[r] = o[r] + __shfl_xor_sync(0xffffffffu, o[r], off);\n      }\n"
_ONE_REDUCTION = """      float kv[R], o[R], dq[R], kq = 0.0f;
      for (int i = 0; i < NPT; ++i) kq = kq + kn[i] * qn[i];
      for (int r = 0; r < R; ++r) {
        kv[r] = 0.0f;
        dq[r] = 0.0f;
        for (int i = 0; i < NPT; ++i) {
          s[r][i] = s[r][i] * gt;
          kv[r] = kv[r] + s[r][i] * kn[i];
          dq[r] = dq[r] + s[r][i] * qn[i];
        }
      }
      for (int off = 16; off > 0; off >>= 1) {
        kq = kq + __shfl_xor_sync(0xffffffffu, kq, off);
        for (int r = 0; r < R; ++r) {
          kv[r] = kv[r] + __shfl_xor_sync(0xffffffffu, kv[r], off);
          dq[r] = dq[r] + __shfl_xor_sync(0xffffffffu, dq[r], off);
        }
      }
      for (int r = 0; r < R; ++r) {
        const float delta = (vt[r] - kv[r]) * bt;
        o[r] = dq[r] + delta * kq;
        for (int i = 0; i < NPT; ++i) s[r][i] = s[r][i] + kn[i] * delta;
      }
"""
_variants: dict = {}


def one_reduction_source(keep: bool) -> str:
    """The product's CUDA source (raw variant) with its two reductions per step made one."""
    src = gd._source(False, keep, True)
    start = src.index("      float kv[R], o[R];\n")
    end = src.index(_TWO_REDUCTIONS_END) + len(_TWO_REDUCTIONS_END)
    return src[:start] + _ONE_REDUCTION + src[end:]


def one_reduction_raw(q, k, v, a, b, A_log, dt_bias, state, *, keep_states=False):
    """Same contract as ``gd.gated_delta_raw_native``, through the experimental kernel."""
    keep = gd._keeps(q, keep_states)
    if keep not in _variants:
        spec = gd._spec(False, keep, True)
        source = one_reduction_source(keep)
        spec |= {"source": source, "name": kernel_name("mtp_gdn_one_reduction", source)}
        _variants[keep] = mx.fast.cuda_kernel(**spec)
    inputs = [q, k, v, a.astype(q.dtype), b.astype(q.dtype), mx.contiguous(A_log),
              mx.contiguous(dt_bias), gd._dense(state)]  # fmt: skip
    types = [("AT", A_log.dtype), ("DT", dt_bias.dtype)]
    out = gd._launch(_variants[keep], inputs, q, k, v, keep, types)
    return gd._with_states(out, keep_states)


def check_one_reduction(T: int = 5) -> dict:
    """The experimental kernel against the product: largest difference, and chain parity
    (T steps in one launch bitwise equal to T one-step launches)."""
    gd._ROWS = 4
    (q, k, v, a, b), states = _inputs(T, 1)
    args = (q, k, v, a, b, A_LOG, DT_BIAS, states[0])
    got = one_reduction_raw(*args, keep_states=True)
    want = gd.gated_delta_raw_native(*args, keep_states=True)
    diff = {n: mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item()
            for n, x, y in zip(("y", "state", "states"), got, want, strict=True)}  # fmt: skip
    s, ys, kept = states[0], [], []
    for t in range(T):
        sl = slice(t, t + 1)
        y, s, _ = one_reduction_raw(q[:, sl], k[:, sl], v[:, sl], a[:, sl], b[:, sl], A_LOG,
                                    DT_BIAS, s)  # fmt: skip
        ys.append(y)
        kept.append(s)
    parity = (mx.array_equal(mx.concatenate(ys, 1), got[0]).item()
              and mx.array_equal(s, got[1]).item()
              and mx.array_equal(mx.stack(kept[:-1]), got[2]).item())  # fmt: skip
    return {"max_abs_diff_vs_product": diff, "chain_parity": parity}


def _arm(rows: int, keep: bool, fn=None):
    def every_layer(q, k, v, a, b, *states):
        gd._ROWS = rows  # read while tracing: each arm's trace keeps its own launch shape
        run = fn or gd.gated_delta_raw_native
        outs = [run(q, k, v, a, b, A_LOG, DT_BIAS, s, keep_states=keep) for s in states]
        return [o[1] for o in outs], [x for o in outs for x in o if x is not None]

    return mx.compile(every_layer)


def side_by_side(rows: list[int], ts: list[int], repeats: int, one: bool = False) -> dict:
    res: dict = {"ms_48_layers": {}, "final_states_equal_first_arm": {}}
    for T in ts:
        xs, states = _inputs(T, LAYERS)
        for keep in (False,) if T == 1 else (False, True):
            arms = {f"rows_{r}": _arm(r, keep) for r in rows}
            if one:
                arms["one_reduction_rows_4"] = _arm(4, keep, one_reduction_raw)
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


def launches_only(rows: list[int], ts: list[int], one: bool = False) -> None:
    arms = [(f"rows={r}", r, gd.gated_delta_raw_native) for r in rows]
    arms += [("one_reduction rows=4", 4, one_reduction_raw)] if one else []
    for T in ts:
        xs, states = _inputs(T, 1)
        for name, r, fn in arms:
            gd._ROWS = r
            for keep in (False,) if T == 1 else (False, True):
                for _ in range(3):
                    mx.eval(fn(*xs, A_LOG, DT_BIAS, states[0], keep_states=keep))
                print(f"T={T} {name} keep={keep}: 3 launches", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--launches-only", action="store_true")
    ap.add_argument("--one-reduction", action="store_true", help="add the experimental arm")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if gd._kernel(False, raw=True) is None:
        raise SystemExit("needs a GPU backend with a native gated-delta kernel")
    if args.launches_only:
        launches_only(args.rows, args.ts, args.one_reduction)
        return
    res = side_by_side(args.rows, args.ts, args.repeats, args.one_reduction)
    if args.one_reduction:
        res["one_reduction_check"] = check_one_reduction()
    res |= {"device": str(mx.device_info().get("device_name", "")), "mlx": mx.__version__,
            "repeats": args.repeats, "chain": CHAIN, "load_after": os.getloadavg()}  # fmt: skip
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gdn_rows.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
