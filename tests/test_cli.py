"""The CLI end to end on the built-in example: text on stdout, statistics on stderr."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from mtpcli.cli import run


def _example_tokenizer():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mtpcli.example import ensure_example

    return load_tokenizer(ensure_example()[0])


def test_generate_json_on_the_example(capsys):
    assert run(["generate", "-p", "hello", "-n", "24", "--json", "--draft-kind", "mtp"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["draft_kind"] == "mtp" and doc["block_size"] == 3
    assert doc["mtp_engaged"] is True and "forced" in doc["gate_reason"]
    assert len(doc["tokens"]) == 24
    assert doc["stats"]["rounds"] > 0 and 0 <= doc["stats"]["acceptance_rate"] <= 1
    for key in ("generation_tps", "prompt_tps", "peak_memory_gb"):
        assert doc["stats"][key] >= 0
    assert "trained on Python's standard library" in captured.err  # says what it is


def test_streams_text_and_puts_stats_on_stderr(capsys):
    argv = ["generate", "-p", "hello", "-n", "16", "--draft-block-size", "4", "--draft-kind", "mtp"]
    assert run(argv) == 0
    captured = capsys.readouterr()
    assert "Generation: 16 tokens" in captured.err and "MTP: block 4" in captured.err
    assert "tokens-per-sec" not in captured.out and captured.out.strip()


def test_json_text_matches_classic(capsys):
    assert run(["generate", "-p", "abc", "-n", "30", "--json", "--draft-kind", "mtp"]) == 0
    mtp = json.loads(capsys.readouterr().out)
    assert run(["generate", "-p", "abc", "-n", "30", "--json", "--draft-kind", "none"]) == 0
    classic = json.loads(capsys.readouterr().out)
    assert classic["draft_kind"] == "none" and classic["stats"]["rounds"] == 0
    assert mtp["tokens"] == classic["tokens"] and mtp["text"] == classic["text"]


def test_prompt_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    assert run(["generate", "-n", "4", "--json", "--ignore-chat-template"]) == 0
    want = len(_example_tokenizer().encode("from stdin"))
    assert json.loads(capsys.readouterr().out)["stats"]["prompt_tokens"] == want


def test_chat_template_and_system_prompt(capsys):
    assert run(["generate", "-p", "hi", "-n", "2", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["stats"]["prompt_tokens"]
    assert run(["generate", "-p", "hi", "-n", "2", "--json", "--system-prompt", "be brief"]) == 0
    with_system = json.loads(capsys.readouterr().out)["stats"]["prompt_tokens"]
    assert plain > len("hi") and with_system > plain


def test_console_script_and_module_entry_points(tmp_path):
    mtp = str(Path(sys.executable).parent / "mtp")  # the script installed beside this Python
    for argv in ([mtp, "--help"], [sys.executable, "-m", "mtpcli", "--help"]):
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        assert "generate" in out and "inspect-weights" in out and "bench" in out
    bad = subprocess.run([mtp, "generate", "-m", str(tmp_path / "nope"), "-p", "x"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr


def test_bad_engine_settings_are_named_errors(capsys, monkeypatch):
    monkeypatch.setenv("MTP_SUBMIT_EVERY", "often")
    assert run(["generate", "-p", "hello", "-n", "4"]) != 0
    err = capsys.readouterr().err
    assert "MTP_SUBMIT_EVERY must be a number of layers" in err and "Traceback" not in err
    monkeypatch.setenv("MTP_SUBMIT_EVERY", "-8")
    assert run(["bench", "--repeats", "1"]) == 2  # read as the target is made, before any run
    err = capsys.readouterr().err
    assert "MTP_SUBMIT_EVERY must be a number of layers" in err and "Traceback" not in err
