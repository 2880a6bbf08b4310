"""The checkpoints every test runs on are what users download: configs, tensor names, ranks and
dtypes compared with published ones (tests/reference/), and with transformers' own config
classes (which import without torch)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mtpcli.fixtures import tiny_text_config, write_drafter, write_target
from mtpcli.synthetic import SHAPES, _text
from mtpcli.weights import read_format, read_inventory

REF = Path(__file__).parent / "reference"
DENSE, MOE, TIED = "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3.5-0.8b"
# The MoE block's tensors, as transformers' Qwen3_5MoeSparseMoeBlock names them, for the dense
# MLP's three.
MOE_MLP = {
    "mlp.gate.weight": (2, "BF16"), "mlp.experts.gate_up_proj": (3, "BF16"),
    "mlp.experts.down_proj": (3, "BF16"), "mlp.shared_expert.gate_proj.weight": (2, "BF16"),
    "mlp.shared_expert.up_proj.weight": (2, "BF16"),
    "mlp.shared_expert.down_proj.weight": (2, "BF16"),
    "mlp.shared_expert_gate.weight": (2, "BF16"),
}  # fmt: skip


def _ref(name: str) -> dict:
    return json.loads((REF / f"{name}.config.json").read_text())


def _keys(d: dict) -> set[str]:
    return set(d)


def _reference_tensors(moe: bool, tied: bool) -> dict[str, tuple[int, str]]:
    table = json.loads((REF / "qwen3.5-0.8b-base.tensors.json").read_text())["tensors"]
    out = {n: (t["rank"], t["dtype"]) for n, t in table.items()}
    if not tied:
        out["lm_head.weight"] = (2, "BF16")
    if moe:
        for prefix in ("model.language_model.layers.{i}.", "mtp.layers.{i}."):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                del out[f"{prefix}mlp.{proj}.weight"]
            out |= {prefix + k: v for k, v in MOE_MLP.items()}
    return out


def _normalised(inv) -> dict[str, tuple[int, str]]:
    return {re.sub(r"\.(layers|blocks)\.\d+\.", r".\1.{i}.", n): (len(i.shape), i.dtype)
            for n, i in inv.items()}  # fmt: skip


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    root = tmp_path_factory.mktemp("realism")
    return {moe: write_target(root / f"raw-{moe}", tiny_text_config(moe=moe), layout="raw")
            for moe in (False, True)}  # fmt: skip


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_raw_config_has_every_published_field(raw, moe):
    ours, ref = json.loads((raw[moe] / "config.json").read_text()), _ref(MOE if moe else DENSE)
    assert _keys(ours) == _keys(ref)
    assert _keys(ours["text_config"]) == _keys(ref["text_config"])
    assert _keys(ours["vision_config"]) == _keys(ref["vision_config"])
    for k in ("architectures", "model_type", "tie_word_embeddings"):
        assert ours[k] == ref[k], k
    for k in ("model_type", "dtype", "mamba_ssm_dtype", "mlp_only_layers", "attn_output_gate"):
        assert ours["text_config"][k] == ref["text_config"][k], k
    rope, ref_rope = ours["text_config"]["rope_parameters"], ref["text_config"]["rope_parameters"]
    assert _keys(rope) == _keys(ref_rope)
    assert {k: v for k, v in rope.items() if k != "mrope_section"} == {
        k: v for k, v in ref_rope.items() if k != "mrope_section"
    }
    n = ours["text_config"]["num_hidden_layers"]
    every = ours["text_config"]["full_attention_interval"]
    assert ours["text_config"]["layer_types"] == [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
    ]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_raw_tensors_have_the_published_names_ranks_and_dtypes(raw, moe):
    ours = _normalised(read_inventory(raw[moe]))
    want = _reference_tensors(moe, tied=False)
    assert sorted(set(ours) ^ set(want)) == []
    assert {n: v for n, v in ours.items() if v != want[n]} == {}
    assert read_format(raw[moe] / "model.safetensors") == "pt"


def test_a_tied_checkpoint_states_it_as_published(tmp_path):
    path = write_target(tmp_path / "t", tiny_text_config(tie_word_embeddings=True), layout="raw")
    ours, ref = json.loads((path / "config.json").read_text()), _ref(TIED)
    assert _keys(ours["text_config"]) == _keys(ref["text_config"])
    assert ours["tie_word_embeddings"] is ours["text_config"]["tie_word_embeddings"] is True
    assert _normalised(read_inventory(path)).keys() == _reference_tensors(False, True).keys()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_mlx_conversion_configs_keep_the_published_fields(tmp_path, moe):
    path = write_target(tmp_path / "t", tiny_text_config(moe=moe), bits=4)
    ours, ref = json.loads((path / "config.json").read_text()), _ref(MOE if moe else DENSE)
    assert _keys(ours) == _keys(ref) | {"quantization", "quantization_config"}
    assert _keys(ours["text_config"]) == _keys(ref["text_config"])
    inv = read_inventory(path)
    patch = inv["vision_tower.patch_embed.proj.weight"].shape  # MLX's [out, T, kH, kW, C]
    assert len(patch) == 5 and patch[-1] == ours["vision_config"]["in_channels"]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_drafter_config_carries_the_whole_text_config(tmp_path, moe):
    path = write_drafter(tmp_path / "d", tiny_text_config(moe=moe), bits=4)
    ours, ref = json.loads((path / "config.json").read_text()), _ref(MOE if moe else DENSE)
    assert _keys(ours) == {"block_size", "model_type", "text_config", "tie_word_embeddings",
                           "quantization", "quantization_config"}  # fmt: skip
    assert _keys(ours["text_config"]) == _keys(ref["text_config"])


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_synthetic_shapes_state_the_published_rope_and_fields(shape):
    family, text = _text(shape)
    ref = _ref(MOE if family == "qwen3_5_moe" else DENSE)["text_config"]
    assert _keys(text) - {"tie_word_embeddings"} == _keys(ref)
    assert text["rope_parameters"]["rope_theta"] == 10000000
    assert text["rope_parameters"]["mrope_interleaved"] is True
    if text["head_dim"] == 256:
        assert text["rope_parameters"]["mrope_section"] == [11, 11, 10]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_transformers_reads_our_configs_as_we_do(raw, moe):
    """transformers' own config classes (no torch needed) take every field with our value."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    ours = json.loads((raw[moe] / "config.json").read_text())
    theirs = (Qwen3_5MoeConfig if moe else Qwen3_5Config).from_dict(ours)
    text, vision = theirs.text_config, theirs.vision_config
    assert {k: v for k, v in ours["text_config"].items() if getattr(text, k, None) != v} == {}
    assert {k: v for k, v in ours["vision_config"].items() if getattr(vision, k, None) != v} == {}
    assert theirs.tie_word_embeddings is text.tie_word_embeddings is False
    assert text.layer_types.count("full_attention") == len(text.layer_types) // 2
