"""An A/B of environment settings on `mtp bench`: one process an arm, arms interleaved by round.

    python scripts/ab_env.py --rounds 3 --out DIR \
        --arm off:MTP_SUBMIT_EVERY=0 --arm every16:MTP_SUBMIT_EVERY=16 -- \
        python -m mtpcli bench --synthetic qwen3.8-27b --block-size 3 \
            --simulate-acceptance 0.7 --repeats 3 -n 64 --no-verify-table --json

Each round runs every arm's process once (the order reversed every other round, so a drift of
the machine moves all arms alike), each with its settings added to the environment and a time
limit. Every process's JSON goes to DIR, with the load average before it. The summary gives,
for each arm, the median (min-max) over its processes of classic and MTP tok/s and of MTP /
classic, whether the tokens always equalled classic's, and each arm's MTP tok/s over the first
arm's in the same round. A process that fails or runs out of time is reported, not counted.
With ``--warmup S`` the command first runs once under the first arm's settings, for up to S
seconds, and is not counted: on a fresh GPU machine the first process compiles every kernel
(session 17: more than 170 s), which would otherwise fall into the first round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from mtpcli.bench import parse_arm, spread


def run_one(command: list[str], env: dict[str, str], limit: float) -> dict:
    """The bench's JSON and its process's outcome; figures for the first block size."""
    load = os.getloadavg()[0]
    try:
        done = subprocess.run(command, env=os.environ | env, capture_output=True, text=True,
                              timeout=limit)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"ran past {limit:.0f} s", "load_before": load}
    if done.returncode != 0:
        return {"ok": False, "why": f"exit {done.returncode}: {done.stderr.strip()[-300:]}",
                "load_before": load}  # fmt: skip
    doc = json.loads(done.stdout)
    block = next(iter(doc["mtp_tps"]))
    arm = doc["arms"].get(f"mtp-{block}", {})
    return {"ok": True, "load_before": load, "classic_tps": doc["classic_tps"],
            "mtp_tps": doc["mtp_tps"][block], "speedup": doc["speedup"][block],
            "same_tokens": arm.get("same_tokens_as_classic"), "doc": doc}  # fmt: skip


def summarize(arms: list[str], rounds: list[dict[str, dict]]) -> dict:
    """Per arm: spreads over its good processes; MTP tok/s over the first arm's, per round."""
    out: dict = {}
    for name in arms:
        good = [r[name] for r in rounds if r[name]["ok"]]
        row: dict = {"failed": [r[name]["why"] for r in rounds if not r[name]["ok"]]}
        if good:
            for key in ("classic_tps", "mtp_tps", "speedup"):
                row[key] = spread([g[key] for g in good], count=True)
            row["same_tokens_always"] = all(g["same_tokens"] for g in good)
        pairs = [r[name]["mtp_tps"] / r[arms[0]]["mtp_tps"] for r in rounds
                 if r[name]["ok"] and r[arms[0]]["ok"]]  # fmt: skip
        if pairs and name != arms[0]:
            row[f"mtp_over_{arms[0]}_per_round"] = spread(pairs, count=True)
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True, help="name:VAR=value[,VAR=value]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=float, default=300.0, help="seconds a process")
    ap.add_argument("--warmup", type=float, default=0.0,
                    help="seconds for one uncounted first run (0: none)")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("command", nargs="+", help="the bench command, after --")
    args = ap.parse_args(argv)
    arms = [parse_arm(a) for a in args.arm]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.warmup > 0:
        res = run_one(args.command, arms[0][1], args.warmup)
        (args.out / "warmup.json").write_text(json.dumps(res, indent=1))
        print(f"warm-up: {'done' if res['ok'] else res['why']} (not counted)", flush=True)
    rounds: list[dict[str, dict]] = []
    for i in range(args.rounds):
        results = {}
        for name, env in arms if i % 2 == 0 else arms[::-1]:
            results[name] = res = run_one(args.command, env, args.limit)
            (args.out / f"{name}_{i}.json").write_text(json.dumps(res, indent=1))
            said = f"mtp {res['mtp_tps']:.2f} tok/s" if res["ok"] else res["why"]
            print(f"round {i} {name}: {said}", flush=True)
        rounds.append(results)
    summary = {"command": args.command, "arms": dict(arms), "rounds": args.rounds,
               "summary": summarize([n for n, _ in arms], rounds)}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["summary"], indent=1))
    return summary


if __name__ == "__main__":
    main()
