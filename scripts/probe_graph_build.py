"""The host's Python build of a decode step and of a verify block as CUDA runs them, layer by
layer against one compiled graph of the whole decoder, on any machine (the graph is built
with CUDA's structure, ``mtpcli.launches.structure_of``; on the GPU itself, as it runs).

    python scripts/probe_graph_build.py --out DIR

Medians (min-max) of ``--n`` passes after the warm-up, ms a pass, with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mtpcli import kernels, launches, synthetic
from mtpcli.engine import prompt_array
from mtpcli.options import Options


def build_times(target, T: int, verify: bool, n: int) -> dict:
    cache = target.make_cache()
    target.prefill(prompt_array(list(range(1, 17))), cache)
    tokens = mx.array([list(range(1, T + 1))])
    times = []
    for i in range(n + 10):  # the first passes run op by op, then settle the row probes
        t0 = time.perf_counter()
        out = target.forward(tokens, cache, verify=verify)
        t1 = time.perf_counter()
        mx.eval(out.hidden, launches.all_cache_arrays(cache))
        if i >= 10:
            times.append((t1 - t0) * 1e3)
    return {"median": round(statistics.median(times), 3), "min": round(min(times), 3),
            "max": round(max(times), 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.8-27b-layers", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    res = {"shape": args.shape, "mlx": mx.__version__, "counted_on": kernels.backend(),
           "load_before": os.getloadavg(), "build_ms": {}}  # fmt: skip
    for path in ("layer by layer", "one graph"):
        options = Options(submit_every=0, graph=path == "one graph")
        with launches.structure_of("cuda"):
            target, _ = synthetic.build(args.shape, bits=4, options=options)
            for T, verify, name in ((1, False, "decode step"), (3, True, "verify block of 3")):
                res["build_ms"][f"{name}, {path}"] = build_times(target, T, verify, args.n)
    res["load_after"] = os.getloadavg()
    for name, r in res["build_ms"].items():
        print(f"{name:34} {r['median']:7.3f} ms ({r['min']:.3f}-{r['max']:.3f})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"graph_build_{args.shape}.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
