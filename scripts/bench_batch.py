"""Time a decode step of a batch of requests (``engine/batch.py``) at several row counts, and
with ``--block`` the MTP rounds of such a batch (``engine/mtp_batch.py``).

    python scripts/bench_batch.py                                     # the built-in example
    python scripts/bench_batch.py --shape qwen3.8-27b --json out.json # a random 27B, 4-bit
    python scripts/bench_batch.py --shape qwen3.8-27b --rows 1 4 8 --block 3 \
        --simulate-acceptance 0.7                                     # and batched MTP rounds

First checks that each row's tokens equal its request decoded alone (``generate_classic``,
greedy, rows joining at different steps; with ``--block``, in MTP rounds too); then, per row
count B, times ``--steps`` batched steps after a warm-up, ``--repeats`` times, interleaved with
classic decoding of one request (the one-at-a-time figure): aggregate tok/s and ms a step,
median (min-max). With ``--block``, B requests in MTP rounds decode ``--steps`` tokens each
(after a warm-up round), their drafts swapped for the classic tokens with probability
``--simulate-acceptance`` (random weights draft nothing right; ``bench.simulated_row_drafts``).
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
from mtpcli.bench import simulated_row_drafts
from mtpcli.engine.batch import Batch
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp_batch import MTPBatch, draft_rows
from mtpcli.example import ensure_example
from mtpcli.loading import load_pair


def _pair(shape: str | None, bits: int):
    if shape is None:
        loaded = load_pair(*map(str, ensure_example()))
        return loaded.target, loaded.drafter, "built-in example"
    target, drafter = synthetic.build(shape, bits=None if bits == 16 else bits)
    return target, drafter, f"synthetic {shape} {bits}-bit (random weights)"


def _prompt(i: int, vocab: int, length: int = 16) -> list[int]:
    return [(31 * i + 7 * j + 3) % min(vocab, 1000) for j in range(length)]


def check_exact(target, rows: int, tokens: int) -> bool:
    """Each of ``rows`` requests, joining one step apart, decodes its solo tokens."""
    vocab = target.config.text.vocab_size
    want = [list(generate_classic(target, _prompt(i, vocab), max_tokens=tokens))
            for i in range(rows)]  # fmt: skip
    return _joining(Batch(target), rows, tokens, vocab) == want


def _joining(batch, rows: int, tokens: int, vocab: int) -> list[list[int]]:
    """Each of ``rows`` requests' tokens, joining ``batch`` one step apart."""
    got, joined = [[] for _ in range(rows)], 0
    while joined < rows or batch.rows:
        if joined < rows:
            batch.add(_prompt(joined, vocab), owner=joined, max_tokens=tokens)
            joined += 1
        batch.advance(got)
    return got


def references(target, rows: int, tokens: int) -> list[list[int]]:
    """Each row's classic greedy tokens (a batch's: each row's are its request's alone)."""
    vocab = target.config.text.vocab_size
    batch, got = Batch(target), [[] for _ in range(rows)]
    for i in range(rows):
        batch.add(_prompt(i, vocab), owner=i, max_tokens=tokens)
    batch.drain(got)
    return got


def check_exact_rounds(target, drafter, refs: list[list[int]], block: int, p: float,
                       round_rows: int | None = None) -> bool:  # fmt: skip
    """Each request, joining one round apart, decodes its classic tokens in MTP rounds."""
    vocab, rows, tokens = target.config.text.vocab_size, len(refs), len(refs[0])
    batch = MTPBatch(target, drafter, block, simulated_row_drafts(refs, p, seed=1), round_rows)
    return _joining(batch, rows, tokens, vocab) == refs


def time_rounds(target, drafter, refs: list[list[int]], block: int, p: float | None,
                seed: int, round_rows: int | None = None) -> tuple[float, int, float]:  # fmt: skip
    """Seconds for every row to decode the rest of its reference in MTP rounds after one
    untimed round, the tokens they emitted meanwhile, and the tokens a step emitted a row."""
    vocab = target.config.text.vocab_size
    propose = draft_rows if p is None else simulated_row_drafts(refs, p, seed)
    batch = MTPBatch(target, drafter, block, propose, round_rows)
    got = [[] for _ in refs]
    for i, ref in enumerate(refs):
        batch.add(_prompt(i, vocab), owner=i, max_tokens=len(ref))
    batch.advance(got)
    before, start = sum(map(len, got)), time.perf_counter()
    rounds = 0
    while batch.rows:
        rows = len(batch.rows)
        batch.advance(got)
        rounds += rows
    elapsed = time.perf_counter() - start
    emitted = sum(map(len, got)) - before
    return elapsed, emitted, emitted / max(rounds, 1)


def time_batch(target, rows: int, steps: int) -> float:
    """Seconds for ``steps`` steps of ``rows`` rows (after 3 untimed ones)."""
    vocab = target.config.text.vocab_size
    batch = Batch(target)
    for i in range(rows):
        batch.add(_prompt(i, vocab), max_tokens=steps + 8)
    for _ in range(3):
        batch.step()
    start = time.perf_counter()
    for _ in range(steps):
        batch.step()
    return time.perf_counter() - start


def time_classic(target, steps: int) -> float:
    vocab = target.config.text.vocab_size
    tokens = generate_classic(target, _prompt(0, vocab), max_tokens=steps + 3)
    for _ in range(3):
        next(tokens)
    start = time.perf_counter()
    for _ in range(steps):
        next(tokens)
    elapsed = time.perf_counter() - start
    tokens.close()
    return elapsed


def time_product(target, rows: list[int], repeats: int = 30) -> dict[str, float]:
    """Median us of MLX's 4-bit product (group 64) at the target's hidden -> vocab shape, for
    each row count: what one batched row costs the backend's quantized product."""
    t = target.config.text
    w = mx.random.normal((t.vocab_size, t.hidden_size)).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    out = {}
    for m in rows:
        x = mx.random.normal((m, t.hidden_size)).astype(mx.bfloat16)
        times = []
        for i in range(repeats + 3):
            start = time.perf_counter()
            mx.eval(mx.quantized_matmul(x, wq, scales, biases, group_size=64, bits=4))
            if i >= 3:
                times.append(time.perf_counter() - start)
        out[str(m)] = statistics.median(times) * 1e6
    return out


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, choices=sorted(synthetic.SHAPES))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--block", type=int, default=None, help="also time MTP rounds of this block")
    ap.add_argument(
        "--simulate-acceptance",
        type=float,
        default=None,
        help="swap each draft for the classic token with this probability",
    )
    ap.add_argument("--round-rows", type=int, default=None,
                    help="rounds up to this many product rows (default: the target's tile; "
                         "0: rounds at every row count)")  # fmt: skip
    args = ap.parse_args()
    target, drafter, label = _pair(args.shape, args.bits)
    exact = check_exact(target, max(args.rows), 12)
    print(f"{label}: each row's tokens equal its request alone: {exact}")
    refs = {}
    round_rows = 1 << 30 if args.round_rows == 0 else args.round_rows
    if args.block:
        p = args.simulate_acceptance
        refs = {b: references(target, b, args.steps + 1) for b in args.rows}
        exact_rounds = check_exact_rounds(target, drafter, refs[max(args.rows)], args.block,
                                          0.5 if p is None else p, round_rows)  # fmt: skip
        print(f"in MTP rounds of {args.block}, each row's tokens equal its request alone: "
              f"{exact_rounds}")  # fmt: skip
        exact = exact and exact_rounds
    load_before = os.getloadavg()
    classic, batched = [], {b: [] for b in args.rows}
    rounds = {b: [] for b in args.rows}
    for rep in range(args.repeats):
        classic.append(args.steps / time_classic(target, args.steps))
        for b in args.rows:
            batched[b].append(b * args.steps / time_batch(target, b, args.steps))
            if args.block:
                secs, emitted, per_round = time_rounds(target, drafter, refs[b], args.block,
                                                       args.simulate_acceptance, rep,
                                                       round_rows)  # fmt: skip
                rounds[b].append((emitted / secs, per_round))
    record = {
        "target": label, "backend": str(mx.default_device()), "exact": exact,
        "steps": args.steps, "repeats": args.repeats,
        "classic_tps": _summary(classic),
        "batch_tps": {str(b): _summary(v) for b, v in batched.items()},
        "load_before": load_before, "load_after": os.getloadavg(),
        "head_product_us": time_product(target, args.rows),
    }  # fmt: skip
    if args.block:
        record["mtp_rounds"] = {
            "block": args.block, "simulated_acceptance": args.simulate_acceptance,
            "round_rows": "every row count" if args.round_rows == 0 else
            args.round_rows or f"the target's tile ({target.tile_rows})",
            "tps": {str(b): _summary([t for t, _ in v]) for b, v in rounds.items()},
            "tokens_per_round": {str(b): statistics.median(r for _, r in v)
                                 for b, v in rounds.items()},
        }  # fmt: skip
    c = record["classic_tps"]
    print(f"classic, one request: {c['median']:.1f} tok/s ({c['min']:.1f}-{c['max']:.1f})")
    for b, s in record["batch_tps"].items():
        print(f"batch of {b}: {s['median']:.1f} tok/s ({s['min']:.1f}-{s['max']:.1f}), "
              f"{s['median'] / c['median']:.2f}x one request, "
              f"{int(b) * 1000 / s['median']:.2f} ms a step")  # fmt: skip
        if args.block:
            m = record["mtp_rounds"]["tps"][b]
            print(f"  in MTP rounds of {args.block}: {m['median']:.1f} tok/s "
                  f"({m['min']:.1f}-{m['max']:.1f}), {m['median'] / s['median']:.2f}x its "
                  f"classic steps, {record['mtp_rounds']['tokens_per_round'][b]:.2f} tokens a "
                  "step a row")  # fmt: skip
    print(
        "4-bit hidden -> vocab product, us by rows:",
        {m: round(us) for m, us in record["head_product_us"].items()},
    )
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
