"""Bad input: each case gets its named error from the library and a clean non-zero CLI exit."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import pytest

from mtpcli import errors as E
from mtpcli.cli import run
from mtpcli.fixtures import tiny_text_config, write_drafter
from mtpcli.loading import load_pair


def _cfg(d: Path, fn) -> None:
    p = d / "config.json"
    c = json.loads(p.read_text())
    fn(c)
    p.write_text(json.dumps(c))


def _text(key, value):
    def fn(c):
        (c["text_config"] if "text_config" in c else c)[key] = value

    return fn


def _tensors(d: Path, fn) -> None:
    f = d / "model.safetensors"
    w = mx.load(str(f))
    fn(w)
    f.unlink()
    mx.save_safetensors(str(f), w)


def _bytes(d: Path, fn) -> None:
    f = d / "model.safetensors"
    f.write_bytes(fn(f.read_bytes()))


def _header_offsets_oob(data: bytes) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10**9]
    hb = json.dumps(header).encode()
    return struct.pack("<Q", len(hb)) + hb + data[8 + n :]


def _symlink_to_text(d: Path) -> None:
    (d / "notes.txt").write_text("not a tensor file\n" * 10)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(d / "notes.txt")


def _weights_dir(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


def _unreadable(d: Path) -> None:
    # Root reads any mode, so make the read itself fail: a config that is a dangling link to
    # a directory entry removed after creation behaves like an unreadable file.
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(d / "missing-target.json")


def _config_socket(d: Path) -> None:
    # A file the process cannot read, even as root: open() on a socket fails.
    import socket

    (d / "config.json").unlink()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(d / "config.json"))
    sock.close()


def _non_utf8(d: Path) -> None:
    (d / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')


# (case id, which directory is broken: "target" | "drafter", mutation, expected error)
CASES = [
    ("config-missing", "target", lambda d: (d / "config.json").unlink(), E.BadConfigError),
    ("config-dangling-link", "target", _unreadable, E.BadConfigError),
    ("config-unreadable", "target", _config_socket, E.BadConfigError),
    ("config-is-dir", "drafter", lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()), E.BadConfigError),
    ("config-non-utf8", "target", _non_utf8, E.BadConfigError),
    ("config-not-json", "drafter", lambda d: (d / "config.json").write_text("{model_type: x"), E.BadConfigError),
    ("config-not-object", "target", lambda d: (d / "config.json").write_text("[1, 2]"), E.BadConfigError),
    ("target-unknown-type", "target", lambda d: _cfg(d, lambda c: c.update(model_type="llama")), E.UnsupportedModelTypeError),
    ("drafter-unknown-type", "drafter", lambda d: _cfg(d, lambda c: c.update(model_type="foo_mtp")), E.UnsupportedModelTypeError),
    ("drafter-no-text-config", "drafter", lambda d: _cfg(d, lambda c: c.pop("text_config")), E.BadConfigError),
    ("block-size-1", "drafter", lambda d: _cfg(d, lambda c: c.update(block_size=1)), E.ConfigOutOfBoundsError),
    ("block-size-99", "drafter", lambda d: _cfg(d, lambda c: c.update(block_size=99)), E.ConfigOutOfBoundsError),
    ("block-size-string", "drafter", lambda d: _cfg(d, lambda c: c.update(block_size="3")), E.ConfigOutOfBoundsError),
    ("hidden-negative", "target", lambda d: _cfg(d, _text("hidden_size", -64)), E.ConfigOutOfBoundsError),
    ("vocab-huge", "target", lambda d: _cfg(d, _text("vocab_size", 10**12)), E.ConfigOutOfBoundsError),
    ("layers-float", "target", lambda d: _cfg(d, _text("num_hidden_layers", 4.0)), E.ConfigOutOfBoundsError),
    ("heads-not-multiple", "drafter", lambda d: _cfg(d, _text("num_key_value_heads", 3)), E.ConfigOutOfBoundsError),
    ("eps-absurd", "target", lambda d: _cfg(d, _text("rms_norm_eps", 5.0)), E.ConfigOutOfBoundsError),
    ("rope-theta-negative", "target", lambda d: _cfg(d, _text("rope_parameters", {"rope_theta": -1.0})), E.ConfigOutOfBoundsError),
    ("quant-bits-7", "target", lambda d: _cfg(d, lambda c: c.update(quantization={"group_size": 32, "bits": 7})), E.ConfigOutOfBoundsError),
    ("safetensors-empty", "drafter", lambda d: _bytes(d, lambda b: b""), E.BadCheckpointError),
    ("safetensors-truncated", "target", lambda d: _bytes(d, lambda b: b[: len(b) // 2]), E.BadCheckpointError),
    ("header-length-absurd", "drafter", lambda d: _bytes(d, lambda b: struct.pack("<Q", 2**62) + b[8:]), E.BadCheckpointError),
    ("header-garbage", "drafter", lambda d: _bytes(d, lambda b: struct.pack("<Q", 16) + b"\x00garbage!garbage" + b[24:]), E.BadCheckpointError),
    ("offsets-out-of-bounds", "target", lambda d: _bytes(d, _header_offsets_oob), E.BadCheckpointError),
    ("tensor-missing", "target", lambda d: _tensors(d, lambda w: w.pop("language_model.model.norm.weight")), E.BadCheckpointError),
    ("tensor-extra", "drafter", lambda d: _tensors(d, lambda w: w.update({"layers.0.extra.weight": mx.zeros((4,))})), E.BadCheckpointError),
    ("tensor-unknown-prefix", "drafter", lambda d: _tensors(d, lambda w: w.update({"model.embed_tokens.weight": mx.zeros((4, 4))})), E.BadCheckpointError),
    ("tensor-wrong-shape", "drafter", lambda d: _tensors(d, lambda w: w.update({"fc.weight": mx.zeros((64, 64))})), E.BadCheckpointError),
    ("tensor-wrong-dtype", "drafter", lambda d: _tensors(d, lambda w: w.update({"norm.weight": mx.zeros((64,), mx.int32)})), E.BadCheckpointError),
    ("weights-symlink-to-text", "drafter", _symlink_to_text, E.BadCheckpointError),
    ("weights-is-dir", "target", _weights_dir, E.BadCheckpointError),
    ("no-weights", "drafter", lambda d: (d / "model.safetensors").unlink(), E.BadCheckpointError),
    ("index-escapes-dir", "target", lambda d: (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}})), E.BadCheckpointError),
    ("no-tokenizer", "target", lambda d: (d / "tokenizer.json").unlink(), E.TokenizerError),
]  # fmt: skip


@pytest.fixture
def pair(ckpts, tmp_path):
    t = shutil.copytree(ckpts.target(), tmp_path / "target")
    d = shutil.copytree(ckpts.drafter(), tmp_path / "drafter")
    return {"target": Path(t), "drafter": Path(d)}


def _assert_cli_error(argv, capsys):
    capsys.readouterr()
    code = run(argv)
    captured = capsys.readouterr()
    assert code != 0
    assert "error:" in captured.err
    assert "Traceback" not in captured.err + captured.out
    return captured.err


@pytest.mark.parametrize("case,which,mutate,error", CASES, ids=[c[0] for c in CASES])
def test_malformed_input(pair, capsys, case, which, mutate, error):
    mutate(pair[which])
    with pytest.raises(error):
        load_pair(str(pair["target"]), str(pair["drafter"]))
    argv = [
        "generate",
        "-m",
        str(pair["target"]),
        "--draft-model",
        str(pair["drafter"]),
        "-p",
        "hi",
        "-n",
        "2",
    ]
    _assert_cli_error(argv, capsys)


def test_unknown_drafter_type_message(pair, capsys):
    _cfg(pair["drafter"], lambda c: c.update(model_type="foo_mtp"))
    argv = ["generate", "-m", str(pair["target"]), "--draft-model", str(pair["drafter"]), "-p", "x"]
    assert "Unsupported model type: foo_mtp" in _assert_cli_error(argv, capsys)


def test_target_given_as_drafter(ckpts, capsys):
    t = ckpts.target()
    with pytest.raises(E.NotStandaloneDrafterError, match="not a drafter"):
        load_pair(str(t), str(t))
    _assert_cli_error(["generate", "-m", str(t), "--draft-model", str(t), "-p", "x"], capsys)


def test_raw_checkpoint_given_as_drafter(ckpts, capsys):
    raw = ckpts.target(layout="raw")
    with pytest.raises(E.NotStandaloneDrafterError, match="15 mtp.* tensors") as info:
        load_pair(str(ckpts.target()), str(raw))
    assert "extract-drafter" in str(info.value)
    _assert_cli_error(
        ["generate", "-m", str(ckpts.target()), "--draft-model", str(raw), "-p", "x"], capsys
    )


def test_drafter_that_does_not_fit(ckpts, tmp_path, capsys):
    text = tiny_text_config(hidden_size=96)
    other = write_drafter(tmp_path / "other", text)
    with pytest.raises(E.DrafterMismatchError, match="hidden_size is 96 in the drafter and 64"):
        load_pair(str(ckpts.target()), str(other))
    _assert_cli_error(
        ["generate", "-m", str(ckpts.target()), "--draft-model", str(other), "-p", "x"], capsys
    )


def test_mtp_kind_with_non_mtp_target(pair, capsys):
    _cfg(pair["target"], lambda c: c.update(model_type="llama"))
    with pytest.raises(E.TargetNotMTPCapableError, match="'llama'.*qwen3_5, qwen3_5_moe"):
        load_pair(str(pair["target"]), str(pair["drafter"]), "mtp")
    argv = ["generate", "-m", str(pair["target"]), "--draft-model", str(pair["drafter"]),
            "--draft-kind", "mtp", "-p", "x"]  # fmt: skip
    _assert_cli_error(argv, capsys)


def test_drafter_given_as_target(ckpts, capsys):
    with pytest.raises(E.UsageError, match="pass it as --draft-model"):
        load_pair(str(ckpts.drafter()), None)
    _assert_cli_error(["generate", "-m", str(ckpts.drafter()), "-p", "x"], capsys)


@pytest.mark.parametrize("ref", ["/no/such/dir", "nobody-here/NoSuchModel-1B"])
def test_missing_model(ref, capsys):
    with pytest.raises(E.ModelNotFoundError):
        load_pair(ref, None)
    _assert_cli_error(["generate", "-m", ref, "-p", "x"], capsys)
    _assert_cli_error(["inspect-weights", ref], capsys)


def test_usage_errors(ckpts, capsys):
    t = str(ckpts.target())
    _assert_cli_error(["generate", "-m", t, "-p", "x", "--draft-block-size", "3"], capsys)
    for extra in (
        ["--temp", "-1"],
        ["--top-p", "0"],
        ["--draft-block-size", "1"],
        ["--draft-kind", "dflash"],
        ["--qmm", "fast"],
        ["--kernels", "cuda"],
    ):
        _assert_cli_error(["generate", "-m", t, "-p", "x", *extra], capsys)
    _assert_cli_error(["bench", "--qmm", "fast"], capsys)


def test_a_block_size_with_mtp_turned_off_says_so(ckpts, capsys):
    """--draft-kind none drops the drafter at load; a block size beside it must not be told
    that --draft-model is missing (it was given)."""
    t, d = str(ckpts.target()), str(ckpts.drafter())
    err = _assert_cli_error(["generate", "-m", t, "--draft-model", d, "--draft-kind", "none",
                             "--draft-block-size", "3", "-p", "x"], capsys)  # fmt: skip
    assert "--draft-kind none" in err and "needs --draft-model" not in err


def test_engine_refuses_batches(load):
    from mtpcli.engine.mtp import generate_mtp

    loaded = load()
    with pytest.raises(E.BatchNotSupportedError):
        next(
            generate_mtp(
                loaded.target,
                loaded.drafter,
                mx.zeros((2, 4), mx.int32),
                block_size=3,
                max_tokens=4,
            )
        )


def test_debug_flag_shows_traceback(capsys):
    with pytest.raises(E.ModelNotFoundError):
        run(["--debug", "generate", "-m", "/no/such/dir", "-p", "x"])
