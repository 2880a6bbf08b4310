"""Time to first text of a chat request whose start an earlier request already had, against a
cold one of the same size: ours (``mtp serve``, MTP forced and classic) and ``mlx_lm.server``
on the built-in example, each started here in turn and spoken to by the openai client,
streaming.

    python scripts/bench_prompt_cache.py --repeats 3 --json out.json

Each repeat takes a system prompt no server has seen (about ``--system-tokens`` tokens) and
sends, in order: a question (cold), another question after the same system prompt (shared
prefix), and the first conversation's next turn (its answer and a new question). Time to first
text is from the request to the first chunk that carries text.
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
import time
from pathlib import Path

import httpx

from mtpcli.example import ensure_example

KINDS = ("cold", "shared_prefix", "next_turn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], port: int, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server stopped: {log.read_text()[-2000:]}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    sys.exit(f"the server did not come up: {log.read_text()[-2000:]}")


def _ask(client, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, list]:
    """(seconds to the first text, the whole text, [prompt tokens, cached prompt tokens])."""
    t0, first, text, cached = time.perf_counter(), None, [], [-1, -1]
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            details = chunk.usage.prompt_tokens_details
            cached = [chunk.usage.prompt_tokens, details.cached_tokens if details else -1]
    return first if first is not None else float("nan"), "".join(text), cached


def _system(r: int, rules: int) -> str:
    """A system prompt no server has seen (``r`` differs), of the same length for every r."""
    return f"Project {r:04d}. " + " ".join(
        f"Rule {i}: keep the parser small and its errors plain." for i in range(rules)
    )


def run_server(name: str, argv: list[str], port: int, model: str, args, out: Path) -> dict:
    from openai import OpenAI

    proc = _start(argv, port, out / f"{name}.log")
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    cached: dict[str, list] = {k: [] for k in KINDS}
    try:
        _ask(client, model, [{"role": "user", "content": "warm up"}], 4)
        for r in range(args.repeats):
            system = {"role": "system", "content": _system(r + 1000 * args.seed, args.rules)}
            q1 = [system, {"role": "user", "content": "def parse_args(argv):"}]
            t, answer, c = _ask(client, model, q1, args.max_tokens)
            times["cold"].append(t), cached["cold"].append(c)
            q2 = [system, {"role": "user", "content": "class Parser:"}]
            t, _, c = _ask(client, model, q2, args.max_tokens)
            times["shared_prefix"].append(t), cached["shared_prefix"].append(c)
            q3 = q1 + [{"role": "assistant", "content": answer},
                       {"role": "user", "content": "and its tests?"}]  # fmt: skip
            t, _, c = _ask(client, model, q3, args.max_tokens)
            times["next_turn"].append(t), cached["next_turn"].append(c)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    summary = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs": v,
                   "prompt_and_cached_tokens": cached[k]} for k, v in times.items()}  # fmt: skip
    for k in KINDS[1:]:
        summary[k]["vs_cold"] = summary[k]["median_s"] / summary["cold"]["median_s"]
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rules", type=int, default=110, help="system prompt: sentences of ~26 tokens")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    if args.repeats < 1 or args.rules < 1 or args.max_tokens < 1:
        ap.error("--repeats, --rules and --max-tokens must be at least 1")
    target, _ = ensure_example()
    load = os.getloadavg()
    p1, p2, p3 = _free_port(), _free_port(), _free_port()
    ours = [sys.executable, "-m", "mtpcli", "serve", "--port"]
    servers = {  # MTP forced (the drafter reads every position's hidden state), and classic
        "ours_mtp": ([*ours, str(p1), "--draft-kind", "mtp"], p1, "example"),
        "ours_classic": ([*ours, str(p2), "--draft-kind", "none"], p2, "example"),
        "mlx_lm": ([sys.executable, "-m", "mlx_lm.server", "--model", str(target), "--port",
                    str(p3)], p3, str(target)),
    }  # fmt: skip
    results = {}
    for i, (name, (argv, port, model)) in enumerate(servers.items()):
        args.seed = i  # a system prompt no server has seen
        results[name] = run_server(name, argv, port, model, args, args.logs)
    import mlx.core as mx
    import mlx_lm

    record = {
        "what": "time to first text of chat requests, built-in example, streaming, temperature 0",
        "ttft": results,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_before": load, "load_after": os.getloadavg()},
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        "command": f"python scripts/bench_prompt_cache.py --repeats {args.repeats} --rules "
                   f"{args.rules} --max-tokens {args.max_tokens}",
    }  # fmt: skip
    for name, s in results.items():
        print(
            name
            + ": "
            + ", ".join(
                f"{k} {s[k]['median_s']:.2f} s ({s[k]['min_s']:.2f}-{s[k]['max_s']:.2f})"
                + (f" {s[k]['vs_cold']:.2f}x cold" if k != "cold" else "")
                for k in KINDS
            )
        )
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
