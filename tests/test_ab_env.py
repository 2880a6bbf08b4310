"""scripts/ab_env.py: arms run as processes with their settings, interleaved, pooled right."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "ab_env.py"
_spec = importlib.util.spec_from_file_location("ab_env", _PATH)
ab_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_env)

# A stand-in for `mtp bench --json`: MTP tok/s from $TPS, classic 10, exit 3 if $FAIL is set,
# and it notes the order the arms ran in.
FAKE = """
import json, os, sys
if os.environ.get("FAIL"):
    sys.exit(3)
with open(os.environ["ORDER"], "a") as f:
    f.write(os.environ["TPS"] + "\\n")
tps = float(os.environ["TPS"])
print(json.dumps({"classic_tps": 10.0, "mtp_tps": {"3": tps}, "speedup": {"3": tps / 10},
                  "arms": {"mtp-3": {"same_tokens_as_classic": True}}}))
"""


def test_arms_run_interleaved_with_their_settings_and_pool_per_round(tmp_path, monkeypatch):
    order = tmp_path / "order.txt"
    monkeypatch.setenv("ORDER", str(order))
    out = ab_env.main(["--rounds", "3", "--out", str(tmp_path / "r"), "--arm", "a:TPS=10",
                       "--arm", "b:TPS=15", "--", sys.executable, "-c", FAKE])  # fmt: skip
    assert order.read_text().split() == ["10", "15", "15", "10", "10", "15"]  # reversed, then back
    s = out["summary"]
    assert s["a"]["mtp_tps"] == {"median": 10.0, "min": 10.0, "max": 10.0, "n": 3}
    assert s["b"]["speedup"]["median"] == 1.5 and s["b"]["same_tokens_always"] is True
    assert s["b"]["mtp_over_a_per_round"]["median"] == 1.5
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["summary"] == s
    assert len(list((tmp_path / "r").glob("b_*.json"))) == 3


def test_a_warmup_runs_first_under_the_first_arm_and_is_not_counted(tmp_path, monkeypatch):
    order = tmp_path / "order.txt"
    monkeypatch.setenv("ORDER", str(order))
    out = ab_env.main(["--rounds", "1", "--warmup", "60", "--out", str(tmp_path / "r"),
                       "--arm", "a:TPS=10", "--arm", "b:TPS=15", "--", sys.executable, "-c",
                       FAKE])  # fmt: skip
    assert order.read_text().split() == ["10", "10", "15"]  # the warm-up, then the round
    assert out["summary"]["a"]["mtp_tps"]["n"] == 1
    assert json.loads((tmp_path / "r" / "warmup.json").read_text())["ok"] is True


def test_a_failing_or_slow_process_is_reported_not_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("ORDER", str(tmp_path / "order.txt"))
    out = ab_env.main(["--rounds", "2", "--out", str(tmp_path), "--arm", "a:TPS=10",
                       "--arm", "b:TPS=12,FAIL=1", "--", sys.executable, "-c", FAKE])  # fmt: skip
    b = out["summary"]["b"]
    assert "mtp_tps" not in b and len(b["failed"]) == 2 and b["failed"][0].startswith("exit 3")
    slow = ab_env.run_one([sys.executable, "-c", "import time; time.sleep(5)"], {}, limit=0.5)
    assert slow["ok"] is False and "ran past" in slow["why"]


@pytest.mark.parametrize("bad", [":X=1", "a:=1", "a:X"])
def test_a_malformed_arm_is_refused(bad):
    with pytest.raises(SystemExit, match="an arm is"):
        ab_env.parse_arm(bad)
    assert ab_env.parse_arm("base") == ("base", {})  # no changes: the baseline
