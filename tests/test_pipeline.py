"""A target split over processes that ``mlx.launch`` starts (the ring backend on 127.0.0.1):
each rank runs its part of the decoder layers, and the tokens are the single process's, classic
and MTP, dense and MoE, bf16 and 4-bit, over prompts of several chunks.

The expected tokens come from ``mtp generate --json`` in this process, unsplit."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mtpcli.cli import run
from mtpcli.errors import PipelineError
from mtpcli.models.pipeline import split

BIN = Path(sys.executable).parent
LONG = "def parse_args(argv):\n" + "    return argv  # keep the parser small\n" * 38  # > 1 chunk


def test_split_gives_rank_0_the_last_layers_and_the_low_ranks_one_more():
    assert split(4, 1) == [range(0, 4)]
    assert split(4, 2) == [range(2, 4), range(0, 2)]
    assert split(4, 3) == [range(2, 4), range(1, 2), range(0, 1)]
    assert split(64, 3) == [range(42, 64), range(21, 42), range(0, 21)]
    with pytest.raises(PipelineError, match="5 processes cannot split the target's 4"):
        split(4, 5)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(n: int, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """``mtp`` under ``mlx.launch -n N`` (its own -n and -p are mlx.launch's: long flags)."""
    argv = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", str(n), "--starting-port",
            str(_port()), "--python", sys.executable, str(BIN / "mtp"), *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def _alone(args: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert run(args) == 0
    return json.loads(out.getvalue())


def _ranks(proc: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(
    ("n", "kind", "prompt", "sampling"),
    [(2, "none", "def parse_args(argv):", []), (2, "mtp", LONG, []),
     (3, "mtp", "def parse_args(argv):", []),
     (2, "mtp", "def main():", ["--temp", "0.8", "--seed", "3"])],
    ids=["2-classic", "2-mtp-long", "3-mtp", "2-mtp-sampled"],
)  # fmt: skip
def test_ranks_give_the_single_process_tokens(n, kind, prompt, sampling):
    args = ["generate", "--prompt", prompt, "--max-tokens", "24", "--json", "--draft-kind", kind,
            *sampling]  # fmt: skip
    want = _alone(args)
    proc = _launch(n, args)
    got = _ranks(proc)
    assert len(got) == 1, proc.stdout + proc.stderr  # rank 0 alone prints
    assert got[0]["tokens"] == want["tokens"] and got[0]["text"] == want["text"]
    assert got[0]["mtp_engaged"] == (kind == "mtp")
    if kind == "mtp":
        assert got[0]["stats"]["rounds"] > 0
    assert want["stats"]["prompt_tokens"] > 512 or prompt != LONG  # a chunk, a cut, the rest


@pytest.mark.parametrize(("moe", "bits"), [(True, 4), (False, None)], ids=["moe-4bit", "bf16"])
def test_ranks_give_the_single_process_tokens_for_other_checkpoints(ckpts, moe, bits):
    t, d = ckpts.target(moe=moe, bits=bits), ckpts.drafter(moe=moe)
    args = ["generate", "-m", str(t), "--draft-model", str(d), "--prompt", "def main():",
            "--max-tokens", "20", "--json", "--draft-kind", "mtp"]  # fmt: skip
    want = _alone(args)
    got = _ranks(_launch(2, args))
    assert [g["tokens"] for g in got] == [want["tokens"]]


def test_more_ranks_than_layers_is_a_named_error_on_every_rank():
    proc = _launch(5, ["generate", "--prompt", "x", "--max-tokens", "4"], timeout=120)
    errors = [line for line in proc.stderr.splitlines()
              if "5 processes cannot split the target's 4 decoder layers" in line]  # fmt: skip
    assert errors and "Traceback" not in proc.stderr
    assert "exited with code 1" in proc.stdout + proc.stderr


def test_serve_split_decodes_one_request_at_a_time(monkeypatch, capsys):
    """Each rank runs this check before it loads anything."""
    import mtpcli.models.pipeline as pipeline

    monkeypatch.setattr(pipeline, "launched", lambda: True)
    assert run(["serve", "--port", str(_port()), "--max-batch", "2"]) == 1
    assert "--max-batch above 1 runs in one process" in capsys.readouterr().err


def test_serve_split_answers_as_one_process_and_stops_on_ctrl_c(tmp_path):
    """``mtp serve`` on 2 ranks: rank 0 serves, the other decodes each request beside it; the
    answers are ``mtp generate``'s in one process (MTP forced, greedy and seeded); Ctrl-C to
    the process group ends a running stream with its last event and every process."""
    import os
    import signal
    import time

    import httpx

    port = _port()
    argv = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", "2", "--starting-port",
            str(_port()), "--python", sys.executable, str(BIN / "mtp"), "serve", "--port",
            str(port), "--draft-kind", "mtp"]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the processes hold it
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    log.close()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, (
                tmp_path / "serve.log"
            ).read_text()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        for prompt, extra, flags in [("def parse_args(argv):", {}, []),
                                     ("class Parser:", {"temperature": 0.8, "seed": 3},
                                      ["--temp", "0.8", "--seed", "3"])]:  # fmt: skip
            body = {"model": "example", "prompt": prompt, "max_tokens": 20} | extra
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            want = _alone(["generate", "--prompt", prompt, "--max-tokens", "20", "--json",
                           "--draft-kind", "mtp", "--ignore-chat-template", *flags])  # fmt: skip
            assert r.json()["choices"][0]["text"] == want["text"]
            assert r.json()["mtp"]["engaged"]
        body = {"model": "example", "prompt": "import os\n", "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            os.killpg(proc.pid, signal.SIGINT)
            rest = [line for line in lines if line]
        proc.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "cancelled"
    assert "rank 0 exited with code 130" in (tmp_path / "serve.log").read_text()


def test_bench_runs_split_and_rank_0_reports():
    """``mtp bench`` under mlx.launch: every rank runs the same generations (the gate's
    calibration a fixed count of them, not a time's worth), rank 0 alone prints the report,
    whose MTP tokens equal its classic ones; --synthetic is refused on every rank."""
    args = ["bench", "--repeats", "1", "--max-tokens", "4", "--block-size", "2",
            "--no-verify-table", "--json"]  # fmt: skip
    proc = _launch(2, args)
    docs = _ranks(proc)
    assert len(docs) == 1, proc.stdout + proc.stderr
    doc = docs[0]
    assert doc["settings"]["processes"] == 2
    assert doc["arms"]["mtp-2"]["same_tokens_as_classic"] is True
    assert doc["classic_tps"] > 0


def test_bench_refuses_what_one_process_alone_can_run_when_split(monkeypatch, capsys):
    """As every rank does before it loads anything."""
    import mtpcli.models.pipeline as pipeline

    monkeypatch.setattr(pipeline, "launched", lambda: True)
    for extra in (["--synthetic", "tiny"], ["--peers"], ["--context", "64"]):
        assert run(["bench", "--repeats", "1", *extra]) == 1
        assert "under mlx.launch, mtp bench runs the built-in example" in capsys.readouterr().err


def test_a_prompt_from_standard_input_is_refused_on_every_rank():
    proc = _launch(2, ["generate", "--max-tokens", "4"], timeout=120)
    assert proc.stderr.count("under mlx.launch the prompt comes with --prompt") == 2, proc.stderr
    assert "Traceback" not in proc.stderr


def _mutant(how: str, args: list[str]) -> subprocess.CompletedProcess:
    argv = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", "2", "--starting-port",
            str(_port()), "--python", sys.executable,
            str(Path(__file__).with_name("pipeline_mutant.py")), how, *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=240)


def test_a_split_that_drops_a_layer_changes_the_tokens():
    """Mutation: the comparison above can fail (a split that skips layer 1)."""
    args = ["generate", "--prompt", "def parse_args(argv):", "--max-tokens", "24", "--json",
            "--draft-kind", "mtp"]  # fmt: skip
    want = _alone(args)
    got = _ranks(_mutant("drop-layer", args))
    assert len(got) == 1 and got[0]["tokens"] != want["tokens"]


def test_a_rank_that_dies_stops_the_other_with_a_named_error():
    proc = _mutant("die", ["generate", "--prompt", "def f():", "--max-tokens", "64"])
    out = proc.stdout + proc.stderr
    assert "exited with code 3" in out and "Traceback" not in out
    assert "error: another process of the pipeline ended" in out or \
        "error: the pipeline lost a process" in out  # fmt: skip


def test_a_lost_process_is_reported_once_whatever_signal_follows():
    """A rank that learns from the ring that another ended reports it, and the SIGTERM that
    mlx.launch sends next cannot cut that report short (under load it once came while the
    error was being printed, and a traceback followed)."""
    import os
    import signal
    import time

    from mtpcli import cli

    old = signal.signal(signal.SIGTERM, cli._pipeline_ended)
    try:
        with pytest.raises(PipelineError, match="lost a process"), cli._pipeline_errors():
            raise RuntimeError("[ring] connection to a peer was lost")
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, while the error is reported
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, old)
