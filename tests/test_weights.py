"""The drafter layout fix (sanitize) and header inventories, on small dicts and files."""

from __future__ import annotations

import mlx.core as mx

from mtpcli.weights import NORM_SHIFT_SUFFIXES, norm_shift_names, read_inventory, sanitize_drafter

# The 15 tensors of a published qwen3_5_mtp head, as a raw checkpoint names them.
RAW_15 = [
    "mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.post_attention_layernorm.weight", "mtp.layers.0.mlp.gate_proj.weight",
    "mtp.layers.0.mlp.up_proj.weight", "mtp.layers.0.mlp.down_proj.weight",
    "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_proj.weight",
    "mtp.layers.0.self_attn.v_proj.weight", "mtp.layers.0.self_attn.o_proj.weight",
    "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
]  # fmt: skip
SHIFTED = {
    "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
    "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
}  # fmt: skip


def _raw():
    return {n: mx.full((2,), float(i)) for i, n in enumerate(RAW_15)}


def test_each_raw_tensor_maps_once_and_exactly_seven_shift():
    raw = _raw()
    out = sanitize_drafter(raw, shift=True)
    assert sorted(out) == sorted(n[len("mtp.") :] for n in RAW_15)
    for i, name in enumerate(RAW_15):
        key = name[len("mtp.") :]
        expect = i + 1.0 if key in SHIFTED else float(i)
        assert out[key].tolist() == [expect, expect], key
    assert len(SHIFTED) == len(NORM_SHIFT_SUFFIXES) == 7


def test_a_head_stored_as_w_is_renamed_not_shifted():
    out = sanitize_drafter(_raw(), shift=False)
    assert all(out[n[len("mtp.") :]].tolist() == [float(i)] * 2 for i, n in enumerate(RAW_15))


def test_sanitize_is_idempotent():
    once = sanitize_drafter(_raw(), shift=True)
    twice = sanitize_drafter(once, shift=True)
    assert set(once) == set(twice)
    assert all(mx.array_equal(once[k], twice[k]).item() for k in once)


def test_standalone_layout_is_never_shifted():
    standalone = {n[len("mtp.") :]: mx.ones((2,)) for n in RAW_15}
    out = sanitize_drafter(standalone, shift=True)
    assert all(v.tolist() == [1.0, 1.0] for v in out.values())
    assert norm_shift_names(standalone) == []


def test_norm_shift_names_lists_the_seven():
    assert {n[len("mtp.") :] for n in norm_shift_names(RAW_15)} == SHIFTED


def test_fused_moe_experts_are_split():
    gate_up = mx.arange(2 * 6 * 3).reshape(2, 6, 3)  # [E, 2I, H]
    out = sanitize_drafter({
        "mtp.layers.0.mlp.experts.gate_up_proj": gate_up,
        "mtp.layers.0.mlp.experts.down_proj": mx.zeros((2, 3, 3)),
    }, shift=True)  # fmt: skip
    assert out["layers.0.mlp.switch_mlp.gate_proj.weight"].tolist() == gate_up[:, :3].tolist()
    assert out["layers.0.mlp.switch_mlp.up_proj.weight"].tolist() == gate_up[:, 3:].tolist()
    assert "layers.0.mlp.switch_mlp.down_proj.weight" in out


def test_inventory_reads_sharded_checkpoints(ckpts):
    single = read_inventory(ckpts.target())
    sharded = read_inventory(ckpts.target(shards=3))
    assert {k: (v.dtype, v.shape) for k, v in single.items()} == {
        k: (v.dtype, v.shape) for k, v in sharded.items()
    }
    assert len({v.file for v in sharded.values()}) == 3
