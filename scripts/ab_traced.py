"""An A/B in one process of a switch that takes effect when layer functions are traced.

    python scripts/ab_traced.py --flag mtpcli.kernels.quantized_matmul:FUSE_RESIDUAL --out DIR

A module attribute read while a step is built is baked into the compiled layer functions, so
it cannot be switched run by run inside one target (and ``kernels.changed()`` would retrace).
Here each arm has its own random-weight target of ``--shape``, built, warmed up and traced with
the attribute at its arm's value (``off``: False, ``on``: True), which is set again before each
of that arm's runs. First each arm's decode step and verify block of 3 are counted as MLX graph
nodes by primitive (``mx.export_to_dot``, nothing submitted while the block is built); then, in
``--reps`` repetitions (arms alternating, the order reversed every other one), the pure build and
encoding of a decode step, a verify block and two drafts (``probe_host_bound.build_costs``) and
a decode run's per-token build, submit, wait and token times (``decode_run``). The summary
pairs ``on`` with ``off`` repetition by repetition. (Session 21 measured the constant inputs and
the products without reshapes this way, each with a flag that is gone now the change is kept.)
"""

from __future__ import annotations

import argparse
import collections
import importlib
import io
import json
import os
import re
import statistics
from pathlib import Path

import mlx.core as mx
import probe_host_bound as phb  # scripts/, beside this one

from mtpcli import synthetic
from mtpcli.bench import spread
from mtpcli.engine import prompt_array
from mtpcli.engine.sampling import SamplingParams, pick

ARMS = {"off": False, "on": True}


def nodes(outputs: list[mx.array]) -> collections.Counter:
    """The unevaluated graph behind ``outputs``, by primitive."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return collections.Counter(re.findall(r'label ="([^"]+)"', dot.getvalue()))


def step_nodes(target, prompt: list[int], warm: int = 6) -> dict:
    """A decode step's and a verify block of 3's graphs (after ``warm`` of each), by primitive."""
    every, target.submit_every = target.submit_every, 0  # the whole block unsubmitted
    cache, greedy = target.make_cache(), SamplingParams()
    target.prefill(prompt_array(prompt), cache)
    one, block = mx.array([[5]]), mx.array([[5, 6, 7]])

    def decode():
        return [pick(target.lm_head(target.forward(one, cache).hidden)[0, -1], greedy)]

    def verify():
        out = target.forward(block, cache, verify=True)
        traces = [x for t in out.traces if t is not None for x in (t.conv_input, t.states)]
        return [target.lm_head(out.hidden, exact=True), *traces]

    for _ in range(warm):
        mx.eval(decode())
        mx.eval(verify())
    res = {}
    for name, build in (("decode_step", decode), ("verify_block_3", verify)):
        outputs = build()
        count = nodes(outputs)
        res[name] = {"total": sum(count.values()), "by_primitive": dict(count.most_common())}
        mx.eval(outputs)
    target.submit_every = every
    return res


def run_ab(module: str, attr: str, shape: str = "qwen3.8-27b", reps: int = 6, n: int = 20,
           tokens: int = 48) -> dict:  # fmt: skip
    """The A/B (see the module's docstring): per-arm node counts, the runs, the summary."""
    mod = importlib.import_module(module)
    prompt = mx.random.randint(0, 1000, (64,), key=mx.random.key(0)).tolist()
    res: dict = {"flag": f"{module}:{attr}", "shape": shape, "load_before": os.getloadavg(),
                 "nodes": {}, "runs": []}  # fmt: skip
    original, targets = getattr(mod, attr), {}
    try:
        for arm, value in ARMS.items():
            setattr(mod, attr, value)
            targets[arm] = synthetic.build(shape, bits=4)
            phb.decode_run(targets[arm][0], prompt, 8, sync=False)  # warm-up: traced with it
        for arm, value in ARMS.items():
            setattr(mod, attr, value)
            res["nodes"][arm] = step_nodes(targets[arm][0], prompt)
        for r in range(reps):
            for arm in list(ARMS)[:: 1 if r % 2 == 0 else -1]:
                setattr(mod, attr, ARMS[arm])
                target, drafter = targets[arm]
                costs = phb.build_costs(target, drafter, prompt, n=n)
                row = {"rep": r, "arm": arm, "build_ms": costs["build_ms"],
                       "submit_ms": costs["submit_ms"],
                       "decode": phb.decode_run(target, prompt, tokens, sync=False)}  # fmt: skip
                res["runs"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        setattr(mod, attr, original)
    res["load_after"] = os.getloadavg()
    res |= summary(res["runs"])
    return res


def _figures(row: dict) -> dict[str, float]:
    out = {
        f"{kind}.{part}": v for kind in ("build_ms", "submit_ms") for part, v in row[kind].items()
    }
    return out | {f"decode.{p}": row["decode"][p] for p in ("build", "submit", "wait", "token")}


def summary(runs: list[dict]) -> dict:
    """Each figure's median per arm, and on / off paired by repetition: median (min-max) and
    how many repetitions fell below 1."""
    by_arm = {arm: {row["rep"]: _figures(row) for row in runs if row["arm"] == arm} for arm in ARMS}
    reps = sorted(set(by_arm["on"]) & set(by_arm["off"]))
    medians = {arm: {k: statistics.median(f[k] for f in rows.values()) for k in rows[reps[0]]}
               for arm, rows in by_arm.items()}  # fmt: skip
    paired = {}
    for k in medians["on"]:
        ratios = [by_arm["on"][r][k] / by_arm["off"][r][k] for r in reps]
        paired[k] = spread(ratios, count=True) | {"below_1": sum(x < 1 for x in ratios)}
    return {"medians": medians, "on_over_off": paired}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flag", required=True, help="module.path:ATTRIBUTE (True in 'on')")
    ap.add_argument("--shape", default="qwen3.8-27b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--n", type=int, default=20, help="build_costs' timed calls a part")
    ap.add_argument("--tokens", type=int, default=48, help="a decode run's tokens")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    module, _, attr = args.flag.partition(":")
    if not module or not attr:
        raise SystemExit(f"--flag is module.path:ATTRIBUTE, got {args.flag!r}")
    try:
        found = hasattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise SystemExit(f"--flag: cannot import {module!r} ({e})") from None
    if not found:
        raise SystemExit(f"--flag: {module} has no attribute {attr!r}")
    res = run_ab(module, attr, args.shape, args.reps, args.n, args.tokens)
    for arm, counts in res["nodes"].items():
        print(arm, {part: c["total"] for part, c in counts.items()}, "nodes")
    for k, v in res["on_over_off"].items():
        print(f"{k:28s} on/off {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f}), "
              f"{v['below_1']} of {v['n']} below 1")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ab_traced.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
