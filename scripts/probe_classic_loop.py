"""Where a classic decode step's time goes inside the decoding loop (as engine.classic runs
it: step n+1 built and submitted before step n's token is read): Python's build, MLX's
encoding (the ``mx.async_eval`` call) and the wait for the token, ms a step.

    python scripts/probe_classic_loop.py --shape qwen3.8-27b --out DIR

A loop paced by the host waits ~0 for its tokens; one paced by the device waits the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtpcli import synthetic
from mtpcli.engine import prompt_array
from mtpcli.engine.sampling import SamplingParams, pick


def loop(target, steps: int) -> dict:
    s = SamplingParams()
    cache = target.make_cache()
    hidden = target.prefill(prompt_array(list(range(1, 65))), cache)
    y = pick(target.lm_head(hidden[:, -1:])[0, -1], s)
    mx.eval(y)
    parts = {"build": [], "encode": [], "wait": [], "step": []}
    last = time.perf_counter()
    for i in range(steps):
        t0 = time.perf_counter()
        out = target.forward(y.reshape(1, 1), cache)
        y_next = pick(target.lm_head(out.hidden)[0, -1], s)
        t1 = time.perf_counter()
        mx.async_eval(y_next)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        if i >= 8:  # each block length's first steps run op by op
            for name, v in (("build", t1 - t0), ("encode", t2 - t1), ("wait", t3 - t2),
                            ("step", t3 - last)):  # fmt: skip
                parts[name].append(v * 1e3)
        last = t3
        y = y_next
    return {name: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                   "max": round(max(v), 3)} for name, v in parts.items()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.8-27b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--steps", type=int, default=72)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    target, _ = synthetic.build(args.shape, bits=args.bits)
    res = {"shape": args.shape, "bits": args.bits, "mlx": mx.__version__,
           "device": str(mx.default_device()), "load_before": os.getloadavg()}  # fmt: skip
    res["ms_a_step"] = loop(target, args.steps)
    res["load_after"] = os.getloadavg()
    for name, r in res["ms_a_step"].items():
        print(f"{name:7} {r['median']:7.3f} ms ({r['min']:.3f}-{r['max']:.3f})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"classic_loop_{args.shape}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
