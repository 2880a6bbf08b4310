"""Where a decode step's and a verify block's time goes on CUDA: GPU time per kind of kernel
against the wall-clock time of the same step.

    python scripts/profile_step.py --wall --out DIR             # wall-clock steps, no profiler
    ncu --profile-from-start off --clock-control none --csv \\
        --metrics gpu__time_duration.sum python scripts/profile_step.py --t 1 > DIR/ncu_t1.csv
    python scripts/profile_step.py --summarize DIR               # the table, from both
    python scripts/profile_step.py --wall --rows 8 32 --out DIR  # batch steps (wall_rows.json)
    ncu ... python scripts/profile_step.py --rows 32 > DIR/ncu_b32.csv

The model is the random-weight 27B shape, 4-bit, after a 64-token prompt, with everything
warmed up (compiled layer functions traced, kernels self-checked). A step is one forward of T
tokens through the path the engine uses (``verify`` for T > 1) with its LM head and argmax.
Under the profiler exactly one step runs between cuProfilerStart and cuProfilerStop, so every
kernel launch of that step, and nothing else, is listed with its duration. The gap between
the sum of kernel durations and the wall-clock step is time the GPU was not running any
kernel of ours: launch latency and host work. With ``--rows B`` a step is one step of B
requests decoded together (``engine/batch.py``: their forward, each row's pick and read), after
prompts of 64 tokens; its files are ``ncu_b{B}.csv``.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtpcli import synthetic
from mtpcli.engine.batch import Batch
from mtpcli.engine.sampling import positions
from mtpcli.models import qwen3_5 as tm

KINDS = (  # substring of a kernel's name -> what it is; the first match wins
    ("mtp_qmm", "quantized matmul (ours)"),
    ("gated_delta", "gated-delta recurrence (ours)"),
    ("mtp_conv", "convolution window (ours)"),
    ("mtp_gated_norm", "gated norm (ours)"),
    ("mtp_attn", "attention (ours)"),
    ("sdpa", "attention (MLX)"),
    ("attention", "attention (MLX)"),
    ("gemv", "dense matmul (MLX)"),
    ("gemm", "dense matmul (MLX)"),
    ("cutlass", "dense matmul (MLX)"),
    ("qmv", "quantized matmul (MLX)"),
    ("qmm", "quantized matmul (MLX)"),
    ("rms", "norms (MLX)"),
    ("arg_reduce", "argmax (MLX)"),
    ("reduce", "reductions (MLX)"),
    ("copy", "copies (MLX)"),
    ("gather", "gathers and slices (MLX)"),
    ("slice", "gathers and slices (MLX)"),
    ("concat", "copies (MLX)"),
)


def _setup(t: int, shape: str = "qwen3.8-27b", target=None):
    """A warmed-up step of t tokens after a 64-token prompt, of ``target`` (by default a new
    random-weight model of ``shape``, 4-bit)."""
    if target is None:
        target, _ = synthetic.build(shape, bits=4)
    cache = target.make_cache()
    target.prefill(mx.random.randint(0, 1000, (1, 64)), cache)
    tokens = mx.random.randint(0, 1000, (1, t))

    def step(sync: bool = True):
        out = target.forward(tokens, cache, verify=t > 1)
        y = mx.argmax(positions(target.lm_head(out.hidden)), axis=-1)
        (mx.eval if sync else mx.async_eval)(y)
        if t > 1:  # keep the cache's length fixed: back to the first of the t positions
            tm.rollback(cache, out.traces, 1, t)
        return y

    for _ in range(5):  # trace, self-check, warm up
        step()
    mx.synchronize()
    return step


def _setup_rows(rows: int, shape: str = "qwen3.8-27b"):
    """A warmed-up step of ``rows`` requests decoded together, after prompts of 64 tokens."""
    target, _ = synthetic.build(shape, bits=4)
    batch = Batch(target)
    for i in range(rows):
        batch.add(mx.random.randint(0, 1000, (64,), key=mx.random.key(i)).tolist(), owner=i,
                  max_tokens=4096)  # fmt: skip

    def step(sync: bool = True):
        out = batch.step()
        (mx.eval if sync else mx.async_eval)(batch.pending())
        return out

    for _ in range(5):  # trace, self-check, warm up
        step()
    mx.synchronize()
    return step


def _timings(step, repeats: int, queued_run) -> dict:
    """ms a step waited for (median, min, max over ``repeats``) and a step of a queued run
    (``queued_run()``'s ms a step, median of 3)."""
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms),
            "queued": statistics.median(queued_run() for _ in range(3))}  # fmt: skip


def wall_rows(rows: list[int], repeats: int, shape: str) -> dict:
    """ms per batch step: each waited for, and steps as the server's loop runs them (a step
    reads the one before it, so one is always queued)."""
    out = {}
    for b in rows:
        step = _setup_rows(b, shape)

        def run(step=step) -> float:
            t0 = time.perf_counter()
            for _ in range(repeats):
                step(sync=False)
            step()
            return (time.perf_counter() - t0) * 1e3 / (repeats + 1)

        out[f"b{b}"] = _timings(step, repeats, run)
        print(f"B={b}: {out[f'b{b}']}", flush=True)
    return out


def wall(ts: list[int], repeats: int, shape: str) -> dict:
    """ms per step: each step waited for (as an MTP round waits to read its tokens), and
    steps queued back to back (as classic decode queues the next step before reading one)."""
    out = {}
    for t in ts:
        step = _setup(t, shape)

        def run(step=step) -> float:
            t0 = time.perf_counter()
            mx.eval([step(sync=False) for _ in range(repeats)])
            return (time.perf_counter() - t0) * 1e3 / repeats

        out[f"t{t}"] = _timings(step, repeats, run)
        print(f"T={t}: {out[f't{t}']}", flush=True)
    return out


def profiled(t: int, rows: int | None = None) -> None:
    step = _setup_rows(rows) if rows else _setup(t)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    step()
    mx.synchronize()
    cuda.cuProfilerStop()


def kind(name: str) -> str:
    low = name.lower()
    return next((what for key, what in KINDS if key in low), "other elementwise (MLX)")


def summarize(directory: Path) -> str:
    walls: dict = {}  # steps of T tokens (wall.json) and batch steps (wall_rows.json)
    for name in ("wall.json", "wall_rows.json"):
        if (directory / name).exists():
            walls |= json.loads((directory / name).read_text())["wall_ms"]
    lines = []
    for path in sorted(directory.glob("ncu_*.csv")):
        t = path.stem.removeprefix("ncu_")  # t1, t3: tokens a step; b32: rows a batch step
        rows = [r for r in csv.DictReader(_csv_lines(path)) if r.get("Metric Name")]
        by_kind: dict[str, list[float]] = {}
        for r in rows:  # gpu__time_duration.sum in ns or us, as ncu labels it
            scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3, "ms": 1e3}
            us = float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]]
            by_kind.setdefault(kind(r["Kernel Name"]), []).append(us)
        total = sum(sum(v) for v in by_kind.values())
        w = walls.get(t)
        if w is None:
            lines += [f"{t.upper()}: no wall-clock run beside it (--wall), skipped", ""]
            continue
        lines += [
            f"{t.upper()}: wall {w['median']:.2f} ms (min {w['min']:.2f}, max {w['max']:.2f}) a "
            f"step waited for, {w['queued']:.2f} ms a step queued back to back; "
            f"{len(rows)} kernels, {total / 1e3:.2f} ms of GPU time",
            "",
            "| kernels | launches | GPU ms | share of wall |",
            "|---|---|---|---|",
        ]
        for what, v in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"| {what} | {len(v)} | {sum(v) / 1e3:.2f} | "
                         f"{100 * sum(v) / 1e3 / w['median']:.0f}% |")  # fmt: skip
        gap = w["median"] - total / 1e3
        lines += [f"| no kernel running (launch, host) | | {gap:.2f} | "
                  f"{100 * gap / w['median']:.0f}% |", ""]  # fmt: skip
    return "\n".join(lines)


def _csv_lines(path: Path):
    """ncu prints its own log lines before the CSV: start at the header."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    return lines[start:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=1, help="tokens per step, under the profiler")
    ap.add_argument("--wall", action="store_true", help="time steps of T = 1 and 3, no profiler")
    ap.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=None,
        help="batch steps of this many requests (the first, under the profiler)",
    )
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--shape", default="qwen3.8-27b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--summarize", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return
    if args.wall:
        res = {
            "wall_ms": (
                wall_rows(args.rows, args.repeats, args.shape)
                if args.rows
                else wall([1, 3], args.repeats, args.shape)
            ),  # fmt: skip
            "shape": args.shape,
            "repeats": args.repeats,
            "device": str(mx.device_info().get("device_name", "")),
            "mlx": mx.__version__,
            "load_after": os.getloadavg(),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        name = "wall_rows.json" if args.rows else "wall.json"
        (args.out / name).write_text(json.dumps(res, indent=1))
        return
    profiled(args.t, args.rows[0] if args.rows else None)


if __name__ == "__main__":
    main()
