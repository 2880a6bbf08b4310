"""The CLI end to end on the built-in example: text on stdout, statistics on stderr."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "Generation: 16 tokens" in captured.err and "of block 4)" in captured.err
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
    monkeypatch.setenv("MTP_KERNELS", "often")  # --kernels' variable
    assert run(["generate", "-p", "hello", "-n", "4"]) == 2
    err = capsys.readouterr().err
    assert "--kernels must be one of auto, native, ops, got 'often'" in err
    assert "Traceback" not in err
    monkeypatch.delenv("MTP_KERNELS")
    assert run(["bench", "--repeats", "1", "--qmm", "fastest"]) == 2
    err = capsys.readouterr().err
    assert "--qmm must be one of auto, mlx, ours" in err and "Traceback" not in err


def test_the_python_api_gives_what_the_cli_gives(capsys):
    """``from mtpcli import load_pair, generate``: the same tokens and text as ``mtp generate``
    on the built-in example, MTP forced and not, and the text streamed piece by piece."""
    import mtpcli
    from mtpcli import GenerateResult, generate, load_pair
    from mtpcli.example import ensure_example

    assert set(mtpcli.__all__) >= {"load_pair", "generate", "GenerateResult", "Options"}
    argv = ["generate", "-p", "def main():", "-n", "20", "--json", "--draft-kind", "mtp"]
    assert run(argv) == 0
    cli = json.loads(capsys.readouterr().out)
    pair = load_pair(*(str(p) for p in ensure_example()))
    pieces = []
    result = generate(pair, "def main():", max_tokens=20, force_mtp=True, on_text=pieces.append)
    assert isinstance(result, GenerateResult) and result.mtp_engaged
    assert result.tokens == cli["tokens"] and result.text == cli["text"] == "".join(pieces)
    assert result.as_dict()["stats"]["rounds"] == result.stats.mtp.rounds > 0
    classic = generate(pair, "def main():", max_tokens=20, block_size=3)
    assert classic.tokens == result.tokens  # temperature 0: the same tokens either way
    with pytest.raises(mtpcli.MtpError, match="^block_size must be in"):  # the API name
        generate(pair, "x", block_size=17)


def test_prefill_reports_its_progress_chunk_by_chunk(load, monkeypatch):
    from mtpcli.engine.classic import generate_classic
    from mtpcli.models import qwen3_5

    monkeypatch.setattr(qwen3_5, "PREFILL_CHUNK", 4)
    seen = []
    loaded = load()
    prompt = list(range(10, 20))
    tokens = list(generate_classic(loaded.target, prompt, max_tokens=4,
                                   on_prefill=lambda *step: seen.append(step)))  # fmt: skip
    assert seen == [(4, 10), (8, 10), (9, 10), (10, 10)]  # chunks, then the last token
    monkeypatch.setattr(qwen3_5, "PREFILL_CHUNK", 2048)
    assert tokens == list(generate_classic(loaded.target, prompt, max_tokens=4))


def test_progress_shows_on_a_terminal_only(monkeypatch):
    import io

    from rich.console import Console

    from mtpcli.cli import PrefillBar, _status
    from mtpcli.models import qwen3_5

    monkeypatch.setattr(qwen3_5, "PREFILL_CHUNK", 4)
    for terminal in (True, False):
        out = io.StringIO()
        console = Console(file=out, force_terminal=terminal, width=80)
        bar = PrefillBar(console)
        for done in (4, 8, 10):
            bar(done, 10)
        with _status(console) as progress:
            progress("loading the target")
        assert bool(out.getvalue()) is terminal
        if terminal:
            assert "prompt" in out.getvalue() and not bar.bar.live.is_started
    quiet = io.StringIO()
    short = PrefillBar(Console(file=quiet, force_terminal=True))
    short(3, 3)  # a prompt of one chunk: no bar
    assert quiet.getvalue() == "" and short.bar is None
