"""Fail closed: every bad input, hostile file, interrupt and broken cache gets a named error (or
Typer's usage message) and its exit code, never a traceback, a hang, or garbage with exit 0.

One row per case: the command, the exit code, and a pattern its message must match. Each row
names the guard it rests on (``guard``); removing that guard makes the row fail. Rows with a
``shell`` command run as a real process (redirections, signals, closed descriptors, files that
would hang a reader); the rest run in this process through ``cli.run``. Two cases live beside
the code they break: two processes writing the gate cache at once (the end of this file) and
the rollback mutations on dense and MoE pairs (``test_exactness.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mtpcli import gate
from mtpcli.cli import run
from mtpcli.fixtures import byte_tokenizer, tiny_text_config, write_tokenizer

MTP = str(Path(sys.executable).parent / "mtp")
GEN = ("generate", "-m", "{t}", "-p", "hi", "-n", "2")
PAIR = ("generate", "-m", "{t}", "--draft-model", "{d}", "-p", "hi", "-n", "2", "--json")


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # after `mtp`; {t} {d} {dq} {raw} {tmp} are filled in
    code: int
    message: str  # a regex the output (stderr, then stdout) must match
    guard: str  # what makes it hold: removing this makes the row fail
    setup: Callable | None = None  # setup(ctx): breaks a file, fakes a part
    shell: str | None = None  # run `bash -c` this (argv filled in as {cmd}) in a real process
    stdin: bytes | None = None
    nobody: bool = False  # run with the effective uid of `nobody` (root reads everything)
    check: Callable | None = None  # check(ctx, out, err): what else must hold afterwards


# --- setups ----------------------------------------------------------------------------------


def _edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _rope(key, value):
    def setup(ctx):
        _edit_json(
            ctx.t / "config.json",
            lambda c: c["text_config"]["rope_parameters"].update({key: value}),
        )  # noqa: E501

    return setup


def _fifo(rel: str):
    def setup(ctx):
        path = ctx.root / rel
        path.unlink()
        os.mkfifo(path)

    return setup


def _zero_link(ctx):
    (ctx.t / "config.json").unlink()
    (ctx.t / "config.json").symlink_to("/dev/zero")


def _oversized(ctx):
    with open(ctx.t / "config.json", "r+b") as f:
        f.truncate(65 << 20)  # sparse: no disk is spent


def _nested(ctx):
    deep = "[" * 200_000 + "]" * 200_000
    (ctx.t / "config.json").write_text('{"model_type": "qwen3_5", "x": ' + deep + "}")


def _template(tmpl: str):
    def setup(ctx):
        _edit_json(ctx.t / "tokenizer_config.json", lambda c: c.update(chat_template=tmpl))

    return setup


def _poison(value: float):
    def setup(ctx):
        f = ctx.t / "model.safetensors"
        w = mx.load(str(f))
        name = "language_model.model.norm.weight"
        w[name] = mx.full(w[name].shape, value, w[name].dtype)
        f.unlink()
        mx.save_safetensors(str(f), w)

    return setup


def _big_tokenizer(ctx):
    vocab = tiny_text_config()["vocab_size"]
    write_tokenizer(ctx.t, byte_tokenizer(vocab + 8))  # ids up to vocab + 7


def _unreadable_dir(ctx):
    ctx.t.chmod(0o000)


def _unreadable_shard(ctx):
    (ctx.t / "model.safetensors").chmod(0o000)


def _readonly_parent(ctx):
    (ctx.root / "ro").mkdir(mode=0o555)


def _interrupt_save(ctx):
    def save(path, *a, **k):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    ctx.monkeypatch.setattr(mx, "save_safetensors", save)


def _bad_raw_head(ctx):
    f = ctx.raw / "model.safetensors"
    w = mx.load(str(f))
    w["mtp.fc.weight"] = w["mtp.fc.weight"][:, :-2]  # no longer fits the config
    f.unlink()
    mx.save_safetensors(str(f), w)


def _fake_calibration(ctx):
    """The gate's calibration, faked (counted in ctx.calibrations); a first run fills the cache."""
    ctx.calibrations = []

    def calibrate(runs, blocks, contexts=(gate.SHORT,), repeats=3):
        ctx.calibrations.append(list(blocks))
        costs = gate.Costs(10.0, dict.fromkeys(blocks, 14.0))
        return gate.Calibration(dict.fromkeys(contexts, costs))

    ctx.monkeypatch.setattr(gate, "calibrate", calibrate)
    assert run([a.format(**ctx.paths) for a in PAIR]) == 0
    assert ctx.calibrations == [[2, 3, 4]]


def _gate_cache(fn):
    """Fill the cache with a real run, then rewrite it with ``fn(data)``."""

    def setup(ctx):
        _fake_calibration(ctx)
        path = ctx.cache / "gate.json"
        data = json.loads(path.read_text())
        fn(data)
        path.write_text(json.dumps(data))

    return setup


def _every(part: str, key: str, value):
    """Set ``key`` of every entry of ``part`` (of a calibration, of its costs at every context
    length; every block's, for round_ms) to ``value``."""

    def fn(data):
        for entry in data[part].values():
            for e in entry["costs"].values() if part == "calibrations" else [entry]:
                e[key] = dict.fromkeys(e[key], value) if key == "round_ms" else value

    return fn


def _gate_dir(ctx):
    (ctx.cache).mkdir(parents=True, exist_ok=True)
    (ctx.cache / "gate.json").mkdir()
    _fake_calibration(ctx)


def _bad_kernels_env(ctx):
    ctx.monkeypatch.setenv("MTP_KERNELS", "fast")


def _bad_prompts(ctx):
    (ctx.root / "prompts.txt").write_bytes(b"def f(\xff\xfe):\n")


def _model_type(value: str):
    def setup(ctx):
        _edit_json(ctx.t / "config.json", lambda c: c.update(model_type=value))

    return setup


def _lone_surrogate(ctx):
    (ctx.root / "prompts.txt").write_text('"\\ud800"\n')


def _lock_fifo(ctx):
    ctx.cache.mkdir(parents=True, exist_ok=True)
    os.mkfifo(ctx.cache / "gate.json.lock")


def _rename_rounds(fn):
    def change(data):
        for entry in data["calibrations"].values():
            for costs in entry["costs"].values():
                costs["round_ms"] = {fn(b): v for b, v in costs["round_ms"].items()}

    return change


def _nan_after_the_prompt(ctx):
    """Every embedding row but the prompt's NaN: the first logits are finite (the prompt's
    rows), the next step's are not (an untied head: the first check cannot see it)."""
    f = ctx.t / "model.safetensors"
    w = mx.load(str(f))
    name = "language_model.model.embed_tokens.weight"
    keep = mx.zeros((w[name].shape[0], 1), mx.bool_)
    keep[mx.array(list(b"hi"))] = True  # the byte tokenizer's ids of the prompt
    w[name] = mx.where(keep, w[name], mx.array(float("nan"), w[name].dtype))
    f.unlink()
    mx.save_safetensors(str(f), w)


# --- checks ----------------------------------------------------------------------------------


def _recalibrated(ctx, out, err):
    assert ctx.calibrations == [[2, 3, 4]] * 2  # the bad entry was measured again
    assert "calibrating the MTP gate" in err and json.loads(out)["draft_kind"] == "mtp"


def _no_out(ctx, out, err):
    leftovers = [p.name for p in ctx.root.iterdir() if p.name.startswith((".out", "out"))]
    assert leftovers == [], leftovers


def _rerun_extracts(ctx, out, err):
    _no_out(ctx, out, err)
    shutil.rmtree(ctx.raw)
    shutil.copytree(ctx.clean_raw, ctx.raw)
    assert run(["extract-drafter", str(ctx.raw), str(ctx.root / "out")]) == 0
    assert sorted(p.name for p in (ctx.root / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def _no_temp_files(ctx, out, err):
    assert [p.name for p in ctx.cache.iterdir() if p.name.startswith(".gate-")] == []


def _inspect(count: int, layout: str, reason: str = ""):
    def check(ctx, out, err):
        doc = json.loads(out)
        assert doc["mtp_tensor_count"] == count and doc["mtp_layout"].startswith(layout)
        assert re.search(reason, doc["reason"]), doc["reason"]

    return check


def _finished(ctx, out, err):
    assert out.strip()  # it generated; the weights were not misread through fd 0


CASES = [
    # Interrupts: exit 130, one line, nothing half-written.
    Case("generate-sigint", ("generate", "-m", "{t}", "-p", "hi", "-n", "4000", "--ignore-chat-template"), 130, r"^error: interrupted\n$", "cli._interruptible", shell="SIGINT"),  # noqa: E501
    Case("extract-interrupted", ("extract-drafter", "{raw}", "{tmp}/out"), 130, r"^error: interrupted\n$", "cli._interruptible + files.written_dir", setup=_interrupt_save, check=_no_out),  # noqa: E501
    # Usage errors: Typer's message, exit 2, no traceback.
    Case("n-zero", ("generate", "-n", "0"), 2, r"Invalid value for '-n' / '--max-tokens'", "cli.run: standalone Typer"),  # noqa: E501
    Case("n-not-a-number", ("generate", "-n", "abc"), 2, r"Invalid value for '-n'", "cli.run: standalone Typer"),  # noqa: E501
    Case("unknown-option", ("generate", "--bogus"), 2, r"No such option:? '?--bogus", "cli.run: standalone Typer"),  # noqa: E501
    Case("bare-mtp", (), 2, r"Usage: mtp \[OPTIONS\] COMMAND", "cli.run: standalone Typer"),
    Case("bench-repeats-zero", ("bench", "--repeats", "0"), 2, r"Invalid value for '--repeats'", "cli.run: standalone Typer"),  # noqa: E501
    # Named errors instead of tracebacks.
    Case("prompt-argv-not-utf8", GEN, 1, r"the prompt is not valid UTF-8", "tokenizer.encode_prompt", shell="BADARGV"),  # noqa: E501
    Case("prompt-stdin-not-utf8", ("generate", "-m", "{t}", "-n", "2"), 1, r"the prompt on stdin is not valid UTF-8", "cli._read_prompt", stdin=b"\xff\xfe hi"),  # noqa: E501
    Case("seed-negative", (*GEN, "--seed", "-1"), 2, r"Invalid value for '--seed'", "cli: --seed min"),  # noqa: E501
    Case("seed-huge", (*GEN, "--seed", str(10**23)), 2, r"Invalid value for '--seed'", "cli: --seed max"),  # noqa: E501
    Case("template-syntax-error", GEN, 1, r"the chat template failed \(TemplateSyntaxError", "tokenizer.encode_prompt", setup=_template("{% for %}")),  # noqa: E501
    Case("template-raises", GEN, 1, r"the chat template failed .*no system role", "tokenizer.encode_prompt", setup=_template("{{ raise_exception('no system role') }}")),  # noqa: E501
    Case("config-nested-200k", GEN, 1, r"nested too deeply", "config.read_json_object", setup=_nested),  # noqa: E501
    Case("rotary-factor-tiny", GEN, 1, r"partial_rotary_factor 1e-09 .* rotates 0 dimensions", "config.TextConfig.from_dict", setup=_rope("partial_rotary_factor", 1e-9)),  # noqa: E501
    Case("model-dir-unreadable", GEN, 1, r"cannot read the model directory .*: Permission denied", "files.readable_dir", setup=_unreadable_dir, nobody=True),  # noqa: E501
    Case("extract-out-is-file", ("extract-drafter", "{raw}", "{t}/config.json"), 1, r"exists and is not a directory", "files.check_output_dir"),  # noqa: E501
    Case("extract-out-unwritable", ("extract-drafter", "{raw}", "{tmp}/ro/out"), 1, r"cannot write under .*/ro: Permission denied", "files.written_dir", setup=_readonly_parent, nobody=True),  # noqa: E501
    Case("extract-out-under-proc", ("extract-drafter", "{raw}", "/proc/mtp-out/drafter"), 1, r"cannot write under /proc/mtp-out", "files.written_dir"),  # noqa: E501
    Case("stdout-closed", GEN, 1, r"standard output is closed", "cli._guard_std_streams", shell="{cmd} >&-"),  # noqa: E501
    Case("bench-prompts-not-utf8", ("bench", "--prompts", "{tmp}/prompts.txt", "--repeats", "1"), 1, r"--prompts .* is not UTF-8", "bench.read_prompts", setup=_bad_prompts),  # noqa: E501
    # Files that would hang a reader or never end.
    Case("config-fifo", GEN, 1, r"config.json .* is a FIFO", "files.regular_file", setup=_fifo("t/config.json"), shell="{cmd}"),  # noqa: E501
    Case("tokenizer-fifo", GEN, 1, r"tokenizer.json .* is a FIFO", "tokenizer.load_tokenizer", setup=_fifo("t/tokenizer.json"), shell="{cmd}"),  # noqa: E501
    Case("drafter-config-fifo", PAIR, 1, r"config.json .* is a FIFO", "files.regular_file", setup=_fifo("d/config.json"), shell="{cmd}"),  # noqa: E501
    Case("config-dev-zero", GEN, 1, r"is a device, socket or other special file", "files.regular_file", setup=_zero_link, shell="{cmd}"),  # noqa: E501
    Case("config-oversized", GEN, 1, r"config.json .* is larger than 64 MiB", "files.MAX_JSON_BYTES", setup=_oversized),  # noqa: E501
    # Garbage with exit 0, no more.
    Case("weights-nan", GEN, 1, r"logits at the first step are not finite", "engine.check_finite", setup=_poison(float("nan"))),  # noqa: E501
    Case("weights-inf", GEN, 1, r"logits at the first step are not finite", "engine.check_finite", setup=_poison(float("inf"))),  # noqa: E501
    Case("tokenizer-past-vocab", GEN, 1, r"has token id 279, but the model embeds only 272", "tokenizer.load_tokenizer", setup=_big_tokenizer),  # noqa: E501
    Case("temp-tiny", (*GEN, "--temp", "1e-40"), 2, r"--temp must be 0 \(greedy\) or in", "sampling.SamplingParams"),  # noqa: E501
    Case("kernels-env-bad", GEN, 2, r"--kernels must be one of auto, native, ops, got 'fast'", "Options.__post_init__", setup=_bad_kernels_env),  # noqa: E501
    Case("temp-inf", (*GEN, "--temp", "inf"), 2, r"--temp must be 0 \(greedy\) or in", "sampling.SamplingParams"),  # noqa: E501
    Case("n-past-positions", ("generate", "-m", "{t}", "-p", "hi", "-n", "4090"), 2, r"exceeds the model's 4096 positions", "engine.check_room"),  # noqa: E501
    Case("n-huge", ("generate", "-m", "{t}", "-p", "hi", "-n", str(10**30)), 2, r"--max-tokens \(10{30}\) plus the prompt \(\d+ tokens\) exceeds", "engine.check_room"),  # noqa: E501
    # extract-drafter writes beside OUT and renames only after its check.
    Case("extract-check-fails", ("extract-drafter", "{raw}", "{tmp}/out"), 1, r"fails the drafter check, so .*/out was not written", "files.written_dir", setup=_bad_raw_head, check=_rerun_extracts),  # noqa: E501
    # The gate cache: validated, merged under a lock, never leaking.
    Case("gate-wrong-version", PAIR, 0, r"gate cache .*: not this version's format", "gate.GateStore._read", setup=_gate_cache(lambda d: d.update(version=99)), check=_recalibrated),  # noqa: E501
    Case("gate-version-only", PAIR, 0, r"dropped all invalid calibrations", "gate.GateStore._read", setup=_gate_cache(lambda d: [d.pop("calibrations"), d.pop("acceptance")]), check=_recalibrated),  # noqa: E501
    Case("gate-round-ms-zero", PAIR, 0, r"dropped 1 invalid calibrations", "gate._valid_calibration", setup=_gate_cache(_every("calibrations", "round_ms", 0)), check=_recalibrated),  # noqa: E501
    Case("gate-step-ms-1e9", PAIR, 0, r"dropped 1 invalid calibrations", "gate._valid_calibration", setup=_gate_cache(_every("calibrations", "step_ms", 1e9)), check=_recalibrated),  # noqa: E501
    Case("gate-entry-not-object", PAIR, 0, r"dropped 1 invalid calibrations", "gate._valid_calibration", setup=_gate_cache(lambda d: d["calibrations"].update(dict.fromkeys(d["calibrations"], 5))), check=_recalibrated),  # noqa: E501
    Case("gate-acceptance-word", PAIR, 0, r"dropped 1 invalid acceptance", "gate._valid_acceptance", setup=_gate_cache(_every("acceptance", "value", "high"))),  # noqa: E501
    Case("gate-acceptance-nan", PAIR, 0, r"dropped 1 invalid acceptance", "gate._valid_acceptance", setup=_gate_cache(_every("acceptance", "value", float("nan")))),  # noqa: E501
    Case("gate-json-is-dir", PAIR, 0, r"gate cache .*: (unreadable|not written)", "gate.GateStore._update", setup=_gate_dir, check=_no_temp_files),  # noqa: E501
    # Messages that name the real cause.
    Case("stdin-closed-with-prompt", GEN, 0, r"Generation: 2 tokens", "cli._guard_std_streams", shell="{cmd} <&-", check=_finished),  # noqa: E501
    Case("stdin-closed-no-prompt", ("generate", "-m", "{t}", "-n", "2"), 1, r"-p was not given and standard input is closed", "cli._read_prompt", shell="{cmd} <&-"),  # noqa: E501
    Case("shard-unreadable", GEN, 1, r"cannot read the weights file .*: Permission denied", "weights._checked_file", setup=_unreadable_shard, nobody=True),  # noqa: E501
    # inspect-weights counts the head in every layout.
    Case("inspect-standalone-drafter", ("inspect-weights", "{d}", "--json"), 0, r"", "inventory.describe", check=_inspect(15, "standalone")),  # noqa: E501
    Case("inspect-quantized-drafter", ("inspect-weights", "{dq}", "--json"), 0, r"", "inventory.describe", check=_inspect(31, "standalone", r"31 tensors .* the head's 15 tensors, 8 of them quantized and stored as weight, scales and biases")),  # noqa: E501
    Case("inspect-raw", ("inspect-weights", "{raw}", "--json"), 0, r"", "inventory.describe", check=_inspect(15, "raw")),  # noqa: E501
    # Text from users and files is printed as it is, never read as markup.
    Case("markup-in-model-path", ("generate", "-m", "{tmp}/nope[/]", "-p", "hi"), 1, r"nope\[/\] does not exist", "cli._error (markup off)"),  # noqa: E501
    Case("markup-tag-in-model-path", ("generate", "-m", "{tmp}/x[bold]y", "-p", "hi"), 1, r"x\[bold\]y does not exist", "cli._error (markup off)"),  # noqa: E501
    Case("serve-batch-block-without-mtp", ("serve", "--max-batch", "2", "--draft-block-size", "3"), 2, r"--max-batch above 1 decodes classic steps unless MTP is forced", "cli.serve"),  # noqa: E501
    Case("markup-in-draft-kind", (*GEN, "--draft-kind", "[/red]"), 2, r"\[/red\]", "cli._error (markup off)"),  # noqa: E501
    Case("markup-in-model-type", GEN, 1, r"\[/\]", "cli._error (markup off)", setup=_model_type("[/]")),  # noqa: E501
    # Where the output goes: a full disk, a file or /proc as bench's directory.
    Case("stdout-full", GEN, 1, r"cannot write to standard output: No space left", "cli._stdout_errors", shell="{cmd} > /dev/full"),  # noqa: E501
    Case("stdout-full-json", (*GEN, "--json"), 1, r"cannot write to standard output: No space left", "cli._stdout_errors", shell="{cmd} > /dev/full"),  # noqa: E501
    Case("bench-out-is-file", ("bench", "--out", "{t}/config.json"), 1, r"exists and is not a directory", "files.writable_dir, before the run"),  # noqa: E501
    Case("bench-out-under-proc", ("bench", "--out", "/proc/mtp-bench"), 1, r"cannot write the results under /proc/mtp-bench", "files.writable_dir, before the run"),  # noqa: E501
    Case("bench-prompts-lone-surrogate", ("bench", "--prompts", "{tmp}/prompts.txt", "--repeats", "1"), 1, r"line 1: its JSON string decodes to a lone surrogate \(U\+D800\)", "bench.read_prompts", setup=_lone_surrogate),  # noqa: E501
    Case("weights-nan-after-the-prompt", ("generate", "-m", "{t}", "-p", "hi", "-n", "4", "--ignore-chat-template"), 1, r"logits at generated token 1 are not finite", "sampling.check_finite", setup=_nan_after_the_prompt),  # noqa: E501
    Case("weights-nan-after-the-prompt-mtp", ("generate", "-m", "{t}", "--draft-model", "{d}", "--draft-kind", "mtp", "-p", "hi", "-n", "4", "--ignore-chat-template"), 1, r"logits at generated token 1 are not finite", "sampling.accept: check_finite", setup=_nan_after_the_prompt),  # noqa: E501
    Case("gate-lock-fifo", PAIR, 0, r"gate cache .* not written \(its lock .* is not a regular file\)", "gate._locked", setup=_lock_fifo, shell="{cmd}"),  # noqa: E501
    Case("gate-round-key-superscript", PAIR, 0, r"dropped 1 invalid calibrations", "gate._valid_calibration: ASCII digits", setup=_gate_cache(_rename_rounds(lambda b: "\u00b2" if b == "2" else b)), check=_recalibrated),  # noqa: E501
    Case("gate-round-ms-tiny", PAIR, 0, r"dropped 1 invalid calibrations", "gate.MIN_MS", setup=_gate_cache(_every("calibrations", "round_ms", 1e-300)), check=_recalibrated),  # noqa: E501
]  # fmt: skip


# --- the runner ------------------------------------------------------------------------------


@pytest.fixture
def ctx(ckpts, monkeypatch, tmp_path_factory):
    # World-traversable, so rows run as `nobody` reach their files.
    root = Path(tempfile.mkdtemp(prefix="mtp-fail-closed-"))
    root.chmod(0o755)
    sources = {
        "t": ckpts.target(),
        "d": ckpts.drafter(),
        "dq": ckpts.drafter(bits=4),
        "raw": ckpts.target(layout="raw"),
    }
    paths = {name: str(shutil.copytree(src, root / name)) for name, src in sources.items()}
    cache = Path(os.environ["MTP_CACHE_DIR"]) / root.name
    monkeypatch.setenv("MTP_CACHE_DIR", str(cache))
    yield SimpleNamespace(
        root=root, monkeypatch=monkeypatch, cache=cache, clean_raw=sources["raw"],
        paths=paths | {"tmp": str(root)}, **{k: Path(v) for k, v in paths.items()},
    )  # fmt: skip
    for p in [root, *root.rglob("*")]:
        with contextlib.suppress(OSError):
            p.chmod(0o755) if p.is_dir() else None
    shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _as_nobody():
    if os.geteuid() != 0:
        yield  # an ordinary user is refused by the modes alone
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def _in_process(case: Case, argv: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    if case.stdin is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(case.stdin)))
    capsys.readouterr()
    with _as_nobody() if case.nobody else contextlib.nullcontext():
        code = run(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _in_a_process(case: Case, argv: list[str]) -> tuple[int, str, str]:
    if case.shell == "SIGINT":  # a real Ctrl-C once text is streaming
        # With the default disposition of SIGINT, whatever the suite's: a suite started in the
        # background of a script inherits SIGINT ignored, and so would the child (Python keeps
        # an inherited SIG_IGN), which then went on to its 4,000 tokens.
        p = subprocess.Popen(
            [MTP, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert p.stdout.read(1)
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        return p.returncode, out.decode(), err.decode()
    if case.shell == "BADARGV":  # bytes that are not UTF-8, as a shell passes them
        args = [MTP, *(a.encode() for a in argv)]
        args[args.index(b"hi")] = b"\xff\xfehi"
        p = subprocess.run(args, capture_output=True, timeout=60)
    else:
        cmd = " ".join(["exec", MTP, *(f"'{a}'" for a in argv)])
        # Rows with a FIFO hang a reader that does not check: the timeout fails them.
        p = subprocess.run(["bash", "-c", case.shell.format(cmd=cmd)], capture_output=True,
                           timeout=60)  # fmt: skip
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fails_closed(case: Case, ctx, capsys, monkeypatch):
    if case.setup is not None:
        case.setup(ctx)
    argv = [a.format(**ctx.paths) for a in case.argv]
    if case.shell is None:
        code, out, err = _in_process(case, argv, capsys, monkeypatch)
    else:
        code, out, err = _in_a_process(case, argv)
    assert "Traceback" not in out + err
    assert code == case.code, (code, err[-2000:])
    assert re.search(case.message, err) or re.search(case.message, out), err[-2000:]
    if case.code not in (0, 2):  # our own errors: one red line
        assert err.count("error:") == 1, err
    if case.check is not None:
        case.check(ctx, out, err)


def test_concurrent_writers_keep_both_entries(tmp_path):
    """Two runs that read the cache before either wrote it: the second write keeps the first's
    entry (it re-reads under the lock) instead of overwriting it."""
    path = tmp_path / "gate.json"
    a, b = gate.GateStore(path), gate.GateStore(path)
    a.put_calibration("shape-a", gate.Calibration.constant(1.0, {3: 1.5}))
    b.put_calibration("shape-b", gate.Calibration.constant(2.0, {3: 2.5}))
    again = gate.GateStore(path)
    assert again.calibration("shape-a", [3]) is not None
    assert again.calibration("shape-b", [3]) is not None


def test_gate_keys_the_pair_by_resolved_path(ctx, capsys):
    """The same pair reached through a link and a relative path shares its acceptance."""
    _fake_calibration(ctx)
    link = ctx.root / "link-to-target"
    link.symlink_to(ctx.t)
    ctx.monkeypatch.chdir(ctx.root)
    capsys.readouterr()
    assert run(["generate", "-m", "link-to-target", "--draft-model", "d", "-p", "hi", "-n", "2",
                "--json"]) == 0  # fmt: skip
    assert "(last run)" in json.loads(capsys.readouterr().out)["gate_reason"]
    data = json.loads((ctx.cache / "gate.json").read_text())
    assert list(data["acceptance"]) == [f"{ctx.t.resolve()}|{ctx.d.resolve()}"]


def test_concurrent_processes_lose_no_entry(tmp_path):
    """Two processes writing the cache at once: every entry of both survives (lock + re-read)."""
    code = (
        "import sys, time\nfrom pathlib import Path\n"
        "from mtpcli.gate import Calibration, GateStore\n"
        "time.sleep(max(0, float(sys.argv[3]) - time.time()))\n"  # start together
        "for i in range(150):\n"
        "    GateStore(Path(sys.argv[1])).put_calibration(f'{sys.argv[2]}-{i}', "
        "Calibration.constant(1.0, {3: 1.5}))\n"
    )
    path = tmp_path / "gate.json"
    start = str(time.time() + 2)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), w, start]) for w in "ab"]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    assert len(json.loads(path.read_text())["calibrations"]) == 300
