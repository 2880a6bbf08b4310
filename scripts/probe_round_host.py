"""Where an MTP round's host time goes: graph nodes, Python build and MLX's encoding, apart.

    python scripts/probe_round_host.py --shape qwen3.8-27b --out DIR
    python scripts/probe_round_host.py --shape qwen3.8-27b-layers --out DIR   # GPU work ~0

For a decode step, a 3-token verify block (exact head, rollback of two positions) and two
chained drafts, after a 64-token prompt and a warm-up (kernels checked, layer functions
traced): the graph's primitive count by kind (``mx.export_to_dot``), the Python build time, the
time of ``mx.async_eval``'s call on an idle queue (MLX's encoding and submission), and the
wall time to the result (ms, median of ``--n``). A cProfile of the verify's build lists the
functions by own time. ``qwen3.8-27b-layers`` has the 27B's 64 layers at tiny widths: the same
graph with almost no GPU work, so its times are the host's alone.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mtpcli import synthetic
from mtpcli.engine import prompt_array
from mtpcli.engine.mtp import CatchUp, draft
from mtpcli.engine.sampling import SamplingParams, pick
from mtpcli.models.qwen3_5 import cache_arrays, rollback


def node_kinds(outputs) -> dict[str, int]:
    """Primitives in the unevaluated graph of ``outputs``, by kind."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        text = Path(f.name).read_text()
    kinds = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', text))
    return dict(kinds.most_common()) | {"total": sum(kinds.values())}


def probe(shape: str, bits: int, n: int) -> dict:
    target, drafter = synthetic.build(shape, bits=bits)
    target.submit_every = 0  # one submission, timed apart
    greedy = SamplingParams()
    cache, dcache = target.make_cache(), drafter.make_cache()
    prompt = mx.random.randint(0, 1000, (64,)).tolist()
    hidden = target.prefill(prompt_array(prompt), cache)
    draft(drafter, target, CatchUp(mx.array(prompt[1:] + [5], mx.uint32), hidden), dcache, 2,
          greedy)  # fmt: skip
    one, block = mx.array([[5]]), mx.array([[5, 6, 7]])

    def decode():
        return [pick(target.lm_head(target.forward(one, cache).hidden)[0, -1], greedy)]

    def verify():
        out = target.forward(block, cache, verify=True)
        logits = target.lm_head(out.hidden, exact=True)
        rollback(cache, out.traces, 1, 3)  # as a round that accepts no draft
        return [logits, *cache_arrays(cache)]

    def drafts():
        d, _ = draft(drafter, target, CatchUp(mx.array([5, 6, 7], mx.uint32), hidden[:, -3:]),
                     dcache, 2, greedy)  # fmt: skip
        drafter.trim(dcache, 3)
        return [d]

    res: dict = {}
    prof = cProfile.Profile()
    for name, fn in (("decode_step", decode), ("verify_block_3", verify), ("drafts_2", drafts)):
        builds, encodes, walls = [], [], []
        for i in range(n + 4):
            mx.synchronize()
            if name == "verify_block_3" and i >= 4:
                prof.enable()
            t0 = time.perf_counter()
            out = fn()
            t1 = time.perf_counter()
            prof.disable()
            if i == 4:
                kinds = node_kinds(out)
            t1 = time.perf_counter()
            mx.async_eval(out)
            t2 = time.perf_counter()
            mx.eval(out)
            t3 = time.perf_counter()
            if i >= 4:  # the first blocks of each length run op by op
                builds.append((t1 - t0) * 1e3)
                encodes.append((t2 - t1) * 1e3)
                walls.append((t3 - t1) * 1e3)
        res[name] = {"nodes": kinds} | {
            part: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                   "max": round(max(v), 3)}
            for part, v in (("build_ms", builds), ("encode_ms", encodes), ("to_result_ms", walls))
        }  # fmt: skip
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:30]
    res["verify_profile_ms_a_block"] = [
        {"function": f"{Path(f).name}:{line}({fn})", "calls": nc / n,
         "own": round(1e3 * tt / n, 4), "cumulative": round(1e3 * ct / n, 4)}
        for (f, line, fn), (_, nc, tt, ct, _) in rows
    ]  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.8-27b", choices=sorted(synthetic.SHAPES))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    res = {"shape": args.shape, "bits": args.bits, "mlx": mx.__version__,
           "device": str(mx.default_device()), "load_before": os.getloadavg()}  # fmt: skip
    res |= probe(args.shape, args.bits, args.n)
    res["load_after"] = os.getloadavg()
    for name in ("decode_step", "verify_block_3", "drafts_2"):
        r = res[name]
        ms = {part: r[part]["median"] for part in ("build_ms", "encode_ms", "to_result_ms")}
        print(f"{name}: nodes {r['nodes']['total']}, ms {ms}")
        print("   ", {k: v for k, v in r["nodes"].items() if k != "total"})
    for row in res["verify_profile_ms_a_block"][:22]:
        print(f"{row['own']:8.3f} {row['cumulative']:8.3f} {row['calls']:6.1f} {row['function']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"round_host_{args.shape}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
