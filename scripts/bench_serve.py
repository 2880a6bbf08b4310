"""Concurrent clients against a server: aggregate tokens/s, latency and time to first text at
1, 4 and 8 clients (``--clients``), ours (``mtp serve``, MTP forced and classic, and requests
decoded together in classic steps and in MTP rounds) and ``mlx_lm.server`` on the built-in
example, each started here in turn and spoken to by the openai client, streaming.

    python scripts/bench_serve.py --requests 3 --max-tokens 64 --json out.json
    python scripts/bench_serve.py --model /root/q27/target --servers ours_classic ours_batched
    python scripts/bench_serve.py --model /root/q27/target --servers ours_batched \
        --max-batch 32 --clients 1 8 16 32

At each concurrency every client sends ``--requests`` chat requests one after another (the
example's held-out prompts, each after a line no server has seen, so that none is cached;
temperature 0). The aggregate is all their completion tokens over the wall time from the first
request to the last answer, median (min-max) over ``--repeats`` runs of the levels in turn;
latency (a request's whole time) and time to first text (to the first chunk with text) are
medians over the runs of each run's p50 and p95.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_prompt_cache import _free_port, _start  # scripts/: starting a server, its port

from mtpcli.example import ensure_example, example_prompts


def _ask(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0, first, tokens = time.perf_counter(), None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return {"latency_s": time.perf_counter() - t0, "ttft_s": first, "tokens": tokens}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _level(client, model: str, clients: int, prompts: list[str], args, run: int) -> dict:
    """``clients`` threads, each sending ``args.requests`` requests in turn; each prompt opens
    with a line of its own (``run``, client, request), so that no server finds it cached."""
    done: list[dict] = []
    lock = threading.Lock()

    def one(c: int) -> None:
        for r in range(args.requests):
            prompt = (
                f"# {run}.{clients}.{c}.{r}\n" + prompts[(c * args.requests + r) % len(prompts)]
            )
            out = _ask(client, model, prompt, args.max_tokens)
            with lock:
                done.append(out)

    threads = [threading.Thread(target=one, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = [d["latency_s"] for d in done]
    ttft = [d["ttft_s"] for d in done if d["ttft_s"] is not None]
    tokens = sum(d["tokens"] for d in done)
    return {
        "clients": clients, "requests": len(done), "completion_tokens": tokens, "wall_s": wall,
        "aggregate_tps": tokens / wall, "latency_p50_s": statistics.median(lat),
        "latency_p95_s": _pct(lat, 0.95), "ttft_p50_s": statistics.median(ttft),
        "ttft_p95_s": _pct(ttft, 0.95),
    }  # fmt: skip


def _spent(port: int) -> dict | None:
    """Our batching server's ``/health`` time (prompts, steps, relay), None from others."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return json.load(r).get("time")
    except (urllib.error.URLError, ValueError):  # no such route, or not JSON
        return None


def run_server(name: str, argv: list[str], port: int, model: str, prompts: list[str], args,
               out: Path) -> dict:  # fmt: skip
    from openai import OpenAI

    proc = _start(argv, port, out / f"{name}.log")
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=900)
    try:
        # a prompt of the runs' kind (a first one of a shape compiles kernels on a GPU)
        _ask(client, model, "# warm-up\n" + prompts[-1], 16)
        # and at the most clients (a batch's row counts compile theirs)
        warm = [threading.Thread(target=_ask, args=(client, model, f"# warm-up {c}\n"
                                                   + prompts[c % len(prompts)], 16))
                for c in range(max(args.clients))]  # fmt: skip
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        runs: dict[int, list[dict]] = {c: [] for c in args.clients}
        for rep in range(args.repeats):  # the levels interleaved, so that drift reaches each
            for c in args.clients:
                before = _spent(port)
                run = _level(client, model, c, prompts, args, rep)
                after = _spent(port)
                if before and after:  # our batching server: where its decoding time went
                    run["server_time"] = {k: after[k] - before[k] for k in after}
                runs[c].append(run)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    levels = {}
    for c, rs in runs.items():
        tps = [r["aggregate_tps"] for r in rs]
        levels[c] = {
            "clients": c, "aggregate_tps": {"median": statistics.median(tps), "min": min(tps),
                                            "max": max(tps)},
            **{k: statistics.median(r[k] for r in rs)
               for k in ("latency_p50_s", "latency_p95_s", "ttft_p50_s", "ttft_p95_s")},
            "runs": rs,
        }  # fmt: skip
    base = levels[args.clients[0]]["aggregate_tps"]["median"]
    return {"levels": list(levels.values()),
            "aggregate_vs_one_client": {c: v["aggregate_tps"]["median"] / base
                                        for c, v in levels.items()}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3, help="requests each client sends")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8],
                    help="concurrency levels; ratios are against the first")  # fmt: skip
    ap.add_argument("--max-batch", type=int, default=8, help="the batched arm's --max-batch")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--logs", type=Path, default=Path("/tmp"))
    ap.add_argument("--model", type=Path, default=None,
                    help="a target directory (scripts/write_synthetic.py writes one of a real "
                         "shape) instead of the built-in example")  # fmt: skip
    ap.add_argument("--draft-model", type=Path, default=None,
                    help="the MTP arms' drafter with --model (write_synthetic.py writes one "
                         "beside the target)")  # fmt: skip
    ap.add_argument(
        "--servers",
        nargs="+",
        default=None,
        help="which of ours_mtp, ours_classic, ours_batched, ours_batched_inline (joining "
        "prompts processed while the batch waits), ours_batched_mtp, mlx_lm (default: all)",
    )
    args = ap.parse_args()
    if min(args.requests, args.repeats, args.max_tokens, args.max_batch, *args.clients) < 1:
        ap.error("--requests, --repeats, --max-tokens, --max-batch and --clients must be at "
                 "least 1")  # fmt: skip
    target = args.model or ensure_example()[0]
    prompts = example_prompts()
    load = os.getloadavg()
    p1, p2, p3, p4, p5, p6 = (_free_port() for _ in range(6))
    name = str(target) if args.model else "example"
    ours = [sys.executable, "-m", "mtpcli", "serve", *(["-m", name] if args.model else []),
            "--port"]  # fmt: skip
    mtp = ["--draft-kind", "mtp", *(["--draft-model", str(args.draft_model)]
                                    if args.draft_model else [])]  # fmt: skip
    servers = {
        "ours_mtp": ([*ours, str(p1), *mtp], p1, name),
        "ours_classic": ([*ours, str(p2), "--draft-kind", "none"], p2, name),
        "ours_batched": ([*ours, str(p4), "--draft-kind", "none", "--max-batch",
                          str(args.max_batch)], p4, name),
        "ours_batched_inline": ([*ours, str(p6), "--draft-kind", "none", "--max-batch",
                                 str(args.max_batch), "--prompts-inline"], p6, name),
        "ours_batched_mtp": ([*ours, str(p5), *mtp, "--max-batch",
                              str(args.max_batch)], p5, name),
        "mlx_lm": ([sys.executable, "-m", "mlx_lm.server", "--model", str(target), "--port",
                    str(p3)], p3, str(target)),
    }  # fmt: skip
    unknown = set(args.servers or ()) - set(servers)
    if unknown:
        ap.error(f"--servers: no server {', '.join(sorted(unknown))}")
    servers = {k: v for k, v in servers.items() if args.servers is None or k in args.servers}
    results = {name: run_server(name, argv, port, model, prompts, args, args.logs)
               for name, (argv, port, model) in servers.items()}  # fmt: skip
    import mlx.core as mx
    import mlx_lm

    record = {
        "what": f"concurrent chat clients, {name}, streaming, temperature 0: aggregate "
                "completion tokens/s over the wall time, latency and time to first text",
        "servers": results,
        "machine": {"platform": platform.platform(), "device": str(mx.default_device()),
                    "cpus": os.cpu_count(),
                    "load_before": load, "load_after": os.getloadavg()},
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        "command": f"python scripts/bench_serve.py --requests {args.requests} --repeats "
                   f"{args.repeats} --max-tokens {args.max_tokens} --clients "
                   f"{' '.join(map(str, args.clients))} --max-batch {args.max_batch}"
                   + (f" --servers {' '.join(args.servers)}" if args.servers else "")
                   + (f" --model {args.model}" if args.model else ""),
    }  # fmt: skip
    for name, r in results.items():
        print(name + ": " + "; ".join(
            f"{v['clients']} clients {v['aggregate_tps']['median']:.1f} tok/s "
            f"({v['aggregate_tps']['min']:.1f}-{v['aggregate_tps']['max']:.1f}), latency p50 "
            f"{v['latency_p50_s']:.2f} s p95 {v['latency_p95_s']:.2f} s, ttft p50 "
            f"{v['ttft_p50_s']:.2f} s" for v in r["levels"]))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
