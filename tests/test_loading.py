"""Every on-disk layout loads through the same path and computes the same function."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mtpcli.config import load_config
from mtpcli.drafters.qwen3_5_mtp import load_drafter
from mtpcli.extract import extract_drafter
from mtpcli.loading import load_pair, resolve_draft_kind, resolve_path
from mtpcli.models.qwen3_5 import load_target

IDS = mx.array([[5, 17, 99, 3, 250, 41]])


def _logits(target_dir: Path) -> mx.array:
    target = load_target(target_dir, load_config(target_dir))
    cache = target.make_cache()
    return target.lm_head(target.prefill(IDS, cache))


def _params(target_dir: Path) -> dict[str, mx.array]:
    model = load_target(target_dir, load_config(target_dir)).model
    return {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_layouts_compute_the_same_function(ckpts, moe):
    reference = _logits(ckpts.target(moe=moe))
    for kw in ({"layout": "flat"}, {"shards": 2}):
        other = _logits(ckpts.target(moe=moe, **kw))
        assert mx.array_equal(reference, other).item(), kw


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_raw_checkpoint_loads_the_same_weights(ckpts, moe):
    """Every weight of the raw layout (norms stored w - 1, PyTorch's conv1d, fused experts)
    loads to the MLX layout's value; it keeps the float32 its file gives the gated norm, so
    the logits agree to bf16 rounding, not bitwise."""
    want, got = _params(ckpts.target(moe=moe)), _params(ckpts.target(moe=moe, layout="raw"))
    assert want.keys() == got.keys()
    assert [k for k in want if not mx.array_equal(want[k], got[k]).item()] == []
    a = _logits(ckpts.target(moe=moe)).astype(mx.float32)
    b = _logits(ckpts.target(moe=moe, layout="raw")).astype(mx.float32)
    assert mx.abs(a - b).max().item() <= 0.05 * mx.abs(a).max().item()


def test_quantized_target_with_router_override_loads(ckpts):
    path = ckpts.target(moe=True, bits=4)
    cfg = json.loads((path / "config.json").read_text())
    overrides = [k for k, v in cfg["quantization"].items() if isinstance(v, dict)]
    assert overrides and all(k.endswith(("mlp.gate", "shared_expert_gate")) for k in overrides)
    target = load_target(path, load_config(path))
    gate = target.layers[0].mlp.gate
    assert gate.bits == 8 and target.layers[0].mlp.switch_mlp.up_proj.bits == 4


def test_quantized_drafter_loads_and_drafts(ckpts):
    loaded = load_pair(str(ckpts.target(bits=4)), str(ckpts.drafter(bits=4)))
    assert loaded.draft_kind == "mtp"
    assert loaded.drafter.module.fc.bits == 4


def test_extract_drafter_from_raw_equals_the_standalone_drafter(ckpts, tmp_path):
    raw = ckpts.target(layout="raw")  # its mtp.* tensors are the predictable drafter's
    out = extract_drafter(raw, tmp_path / "extracted")
    tcfg = load_config(ckpts.target())
    target = load_target(ckpts.target(), tcfg)
    a = load_drafter(out, load_config(out), target.embed_tokens).module
    b_dir = ckpts.drafter()
    b = load_drafter(b_dir, load_config(b_dir), target.embed_tokens).module
    fa, fb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert fa.keys() == fb.keys()
    assert all(mx.array_equal(fa[k], fb[k]).item() for k in fa)


def test_hf_repo_id_resolves_offline_through_cache_symlinks(ckpts, tmp_path, monkeypatch):
    """A downloaded snapshot (files are symlinks into blobs/) works with no network."""
    src = ckpts.drafter()
    repo = tmp_path / "hub" / "models--mlx-community--Tiny-MTP-bf16"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for f in src.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    path = resolve_path("mlx-community/Tiny-MTP-bf16")
    assert path.resolve() == snap.resolve()
    loaded = load_pair(str(ckpts.target()), "mlx-community/Tiny-MTP-bf16")
    assert loaded.draft_kind == "mtp"


@pytest.mark.parametrize(
    "requested,drafter,expected",
    [("auto", "qwen3_5_mtp", "mtp"), ("auto", None, "none"), ("mtp", "qwen3_5_mtp", "mtp"),
     ("none", "qwen3_5_mtp", "none"), ("none", "whatever", "none")],
)  # fmt: skip
def test_draft_kind_resolution(requested, drafter, expected):
    assert resolve_draft_kind(requested, drafter, "qwen3_5") == expected


def test_mtp_num_hidden_layers_is_not_a_signal(ckpts):
    """The target config claims an MTP layer; with no drafter, decoding is classic."""
    t = ckpts.target()
    assert load_config(t).text.mtp_num_hidden_layers == 1
    assert load_pair(str(t), None).draft_kind == "none"


def test_draft_kind_none_ignores_the_drafter_entirely(ckpts):
    loaded = load_pair(str(ckpts.target()), "/no/such/drafter", "none")
    assert loaded.draft_kind == "none" and loaded.drafter is None
