"""``mtp generate`` over 1, 2, ... processes (``mlx.launch``, ring backend, this machine), classic
and MTP, each a median (min-max) of repeats, with the tokens checked against one process's.

    python scripts/bench_pipeline.py --ranks 1 2 --repeats 3 --json out.json
    python scripts/write_synthetic.py qwen3.5-small /tmp/small --bits 4
    python scripts/bench_pipeline.py -m /tmp/small/target --draft-model /tmp/small/drafter

On one machine the stages of one sequence run one after another, so a split adds its messages
and a second process's overheads and saves nothing: what it costs per forward is the figure
(``added_ms_per_forward``: a forward is a decode step, or a verify with MTP), beside what the
messages of one forward alone take between two processes (``messages_ms_2_ranks``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
PROMPT = "def parse_args(argv):"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(ranks: int, args: list[str]) -> dict:
    """One ``mtp generate --json`` run over ``ranks`` processes: rank 0's record."""
    mtp = [str(BIN / "mtp"), "generate", *args, "--json"]
    if ranks > 1:
        mtp = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", str(ranks), "--starting-port",
               str(_port()), "--python", sys.executable, *mtp]  # fmt: skip
    proc = subprocess.run(mtp, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if len(lines) != 1:
        sys.exit(f"{ranks} ranks: no record\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[0])


def messages_worker(hidden: list[int], repeats: int) -> None:
    """Under ``mlx.launch -n 2``: what a forward's messages cost (rank 1 sends the hidden state
    [1, T, H] to rank 0, then rank 0's goes to both: the split's send, receive and gather),
    median ms over repeats, printed by rank 0 as JSON."""
    import time

    import mlx.core as mx

    g = mx.distributed.init()
    out = {}
    for H in hidden:
        for T in (1, 4):
            x = mx.ones((1, T, H), mx.bfloat16)
            mx.eval(x)
            times = []
            for _ in range(repeats + 3):
                t0 = time.perf_counter()
                h = mx.distributed.send(x, 0, group=g) if g.rank() == 1 else \
                    mx.distributed.recv_like(x, 1, group=g)  # fmt: skip
                mx.eval(mx.distributed.all_gather(h, group=g))
                times.append((time.perf_counter() - t0) * 1000)
            out[f"H={H} T={T}"] = statistics.median(times[3:])
    if g.rank() == 0:
        print(json.dumps(out), flush=True)


def messages(hidden: list[int], repeats: int) -> dict:
    argv = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", "2", "--starting-port",
            str(_port()), "--python", sys.executable, __file__, "--messages-worker",
            "--hidden", *map(str, hidden), "--repeats", str(repeats)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[128, 5120],
        help="hidden sizes whose messages are timed (the example's, the 27B's)",
    )
    ap.add_argument("--messages-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.messages_worker:
        messages_worker(args.hidden, args.repeats)
        return
    if args.repeats < 1 or args.max_tokens < 1 or min(args.ranks) < 1 or 1 not in args.ranks:
        ap.error("--repeats and --max-tokens at least 1; --ranks must include 1")
    pair = ["-m", args.model] if args.model else []
    pair += ["--draft-model", args.draft_model] if args.draft_model else []
    load = os.getloadavg()
    out: dict = {}
    for kind in ("none", "mtp"):
        common = [*pair, "--prompt", PROMPT, "--max-tokens", str(args.max_tokens),
                  "--draft-kind", kind]  # fmt: skip
        rows: dict = {}
        for _ in range(args.repeats):  # ranks in turn each repeat: a drift moves them alike
            for n in args.ranks:
                rows.setdefault(n, []).append(generate(n, common))
        alone = rows[1][0]["tokens"]
        out[kind] = {}
        for n, recs in rows.items():
            tps = [r["stats"]["generation_tps"] for r in recs]
            s = recs[0]["stats"]
            per_fwd = s.get("tokens_per_verify") or 1.0  # classic: a token a forward
            out[kind][n] = {
                "tok_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
                "tokens_equal_one_process": all(r["tokens"] == alone for r in recs),
                "tokens_per_forward": per_fwd,
                "ms_per_forward": 1000 * per_fwd / statistics.median(tps),
            }
        for n in args.ranks:
            out[kind][n]["added_ms_per_forward"] = (out[kind][n]["ms_per_forward"]
                                                    - out[kind][1]["ms_per_forward"])  # fmt: skip
    import mlx.core as mx

    record = {
        "what": "mtp generate tok/s over 1..N processes on one machine (mlx.launch, ring)",
        "model": args.model or "built-in example", "results": out,
        "messages_ms_2_ranks": messages(args.hidden, max(args.repeats, 50)),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_before": load, "load_after": os.getloadavg()},
        "versions": {"mlx": mx.__version__},
        "command": "python scripts/bench_pipeline.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    for kind, res in out.items():
        for n, r in res.items():
            t = r["tok_s"]
            print(f"{'classic' if kind == 'none' else 'mtp'} {n} rank(s): {t['median']:.1f} tok/s "
                  f"({t['min']:.1f}-{t['max']:.1f}), {r['ms_per_forward']:.2f} ms a forward "
                  f"(+{r['added_ms_per_forward']:.2f}), tokens equal: "
                  f"{r['tokens_equal_one_process']}")  # fmt: skip
    print(
        "a forward's messages, 2 ranks, median ms: "
        + ", ".join(f"{k} {v:.3f}" for k, v in record["messages_ms_2_ranks"].items())
    )
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
