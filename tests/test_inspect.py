"""``mtp inspect-weights`` tells the layouts apart from headers alone."""

from __future__ import annotations

import json

import pytest

from mtpcli.cli import run

SHIFTED = {
    "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
    "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
    "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
}  # fmt: skip


def _inspect(path, capsys) -> dict:
    capsys.readouterr()
    assert run(["inspect-weights", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_standalone_drafter(ckpts, capsys):
    info = _inspect(ckpts.drafter(), capsys)
    assert info["model_type"] == "qwen3_5_mtp"
    assert info["layout"] == "standalone MLX drafter"
    assert info["tensor_count"] == 15 and info["mtp_tensor_count"] == 15  # all of it is the head
    assert info["mtp_layout"].startswith("standalone")
    assert info["norm_shift"] == [] and info["drafter_ok"] is True
    assert info["block_size"] == 3


def test_raw_checkpoint_with_mtp(ckpts, capsys):
    info = _inspect(ckpts.target(layout="raw"), capsys)
    assert info["layout"] == "raw checkpoint with MTP tensors"
    assert info["mtp_tensor_count"] == 15
    assert set(info["norm_shift"]) == SHIFTED
    assert info["drafter_ok"] is False and "extract-drafter" in info["reason"]
    assert info["mtp_claim_unbacked"] is False


@pytest.mark.parametrize("bits", [None, 4])
def test_mlx_target(ckpts, capsys, bits):
    info = _inspect(ckpts.target(bits=bits), capsys)
    assert info["layout"] == "MLX target (VLM layout)"
    assert info["mtp_tensor_count"] == 0 and info["drafter_ok"] is False
    # The config says mtp_num_hidden_layers: 1 but there are no MTP weights: say so.
    assert info["config_mtp_layers"] == 1 and info["mtp_claim_unbacked"] is True
    assert (info["quantization"] or {}).get("bits") == bits
    assert ("U32" in info["dtypes"]) == (bits is not None)


def test_table_output(ckpts, capsys):
    capsys.readouterr()
    assert run(["inspect-weights", str(ckpts.target(layout="raw"))]) == 0
    out = capsys.readouterr().out
    assert "raw checkpoint with MTP tensors" in out and "mtp.fc.weight" in out


def test_reads_no_tensor_data(ckpts, tmp_path, capsys, monkeypatch):
    """Headers only: mx.load is never called."""
    import mlx.core as mx

    monkeypatch.setattr(mx, "load", lambda *a, **k: pytest.fail("tensor data was read"))
    assert _inspect(ckpts.target(bits=4), capsys)["tensor_count"] > 0


def test_extract_drafter_command(ckpts, tmp_path, capsys):
    out = tmp_path / "drafter"
    assert run(["extract-drafter", str(ckpts.target(layout="raw")), str(out)]) == 0
    info = _inspect(out, capsys)
    assert info["drafter_ok"] is True and info["tensor_count"] == 15 and info["block_size"] == 3
    # Not from a checkpoint without MTP tensors, and never over a non-empty directory.
    capsys.readouterr()
    assert run(["extract-drafter", str(ckpts.target()), str(tmp_path / "x")]) != 0
    assert "no mtp.* tensors" in capsys.readouterr().err
    assert run(["extract-drafter", str(ckpts.target(layout="raw")), str(out)]) != 0


def test_sharded_raw_checkpoint(ckpts, capsys):
    info = _inspect(ckpts.target(layout="raw", shards=3), capsys)
    assert info["layout"] == "raw checkpoint with MTP tensors" and info["mtp_tensor_count"] == 15
