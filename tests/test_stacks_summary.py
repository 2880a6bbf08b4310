"""scripts/stacks_summary.py: samples charged to the innermost line of the project's code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "stacks_summary.py"
_spec = importlib.util.spec_from_file_location("stacks_summary", _PATH)
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)

STACKS = [
    "thread (1);main (scripts/x.py:9);generate_mtp (mtpcli/engine/mtp.py:100);"
    "forward (mtpcli/models/qwen3_5.py:500) 6",
    "thread (1);main (scripts/x.py:9);generate_mtp (mtpcli/engine/mtp.py:100);"
    "forward (mtpcli/models/qwen3_5.py:500);__call__ (mlx/nn/base.py:3) 2",  # MLX's own frame
    "thread (1);main (scripts/x.py:9);generate_mtp (mtpcli/engine/mtp.py:100);"
    "prefill (mtpcli/models/qwen3_5.py:509) 5",
    "thread (1);main (scripts/x.py:9);generate_mtp (mtpcli/engine/mtp.py:101) 2",
    "thread (1);main (scripts/x.py:9);generate_classic (mtpcli/engine/classic.py:41) 9",
    "thread (2);worker (libmlx.so) 7",
    "",
]


def test_samples_go_to_the_innermost_project_line_within_the_function():
    total, found = summary.shares(STACKS, "generate_mtp", ("prefill",))
    assert total == 10  # 6 + 2 + 2: not the prefill, not classic, not the other thread
    assert found == {"forward (mtpcli/models/qwen3_5.py:500)": 0.8,
                     "generate_mtp (mtpcli/engine/mtp.py:101)": 0.2}  # fmt: skip
    assert summary.shares(STACKS, "nothing here") == (0, {})
    total, found = summary.shares(STACKS, "generate_mtp", ("prefill",), leaf=True)
    assert total == 10 and found == {"forward (mtpcli/models/qwen3_5.py:500)": 0.6,
                                     "__call__ (mlx/nn/base.py:3)": 0.2,
                                     "generate_mtp (mtpcli/engine/mtp.py:101)": 0.2}  # fmt: skip


def test_the_command_line_prints_the_shares(tmp_path):
    path = tmp_path / "stacks.txt"
    path.write_text("\n".join(STACKS) + "\n")
    out = subprocess.run([sys.executable, str(_PATH), str(path), "--within", "generate_mtp"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.splitlines()[0] == "15 samples within generate_mtp"
    assert "53.3%  forward (mtpcli/models/qwen3_5.py:500)" in out  # 8 of 15
