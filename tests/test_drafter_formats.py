"""Drafters as users have them: quantized at load or by ``extract-drafter --quantize``, taken
from sharded, MoE and block-FP8 raw checkpoints; at temperature 0 MTP still equals classic."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mtpcli import bench
from mtpcli.cli import run
from mtpcli.config import load_config
from mtpcli.drafters.qwen3_5_mtp import load_drafter
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp
from mtpcli.errors import BadConfigError, UsageError
from mtpcli.extract import extract_drafter
from mtpcli.loading import load_pair
from mtpcli.models.qwen3_5 import load_target
from mtpcli.weights import e4m3_values, load_arrays

PROMPTS = [[72, 101, 108, 108, 111], [(i * 37) % 250 for i in range(40)]]
LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _mtp_equals_classic(loaded, block: int = 3, n: int = 32) -> None:
    for p in PROMPTS:
        classic = list(generate_classic(loaded.target, p, max_tokens=n))
        mtp = list(generate_mtp(loaded.target, loaded.drafter, p, block_size=block, max_tokens=n))
        assert mtp == classic


def _params(module) -> dict[str, mx.array]:
    return dict(tree_flatten(module.parameters()))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_drafter_quantized_at_load_keeps_mtp_exact(ckpts, bits):
    target, drafter = str(ckpts.target(bits=4)), str(ckpts.drafter())
    loaded = load_pair(target, drafter, draft_quantize=bits)
    m = loaded.drafter.module
    quantized = [k for k in _params(m) if k.endswith(".scales")]
    assert len(quantized) == len(LINEARS) and m.fc.bits == bits
    assert loaded.drafter.config.quantization["bits"] == bits
    assert loaded.pair_key != load_pair(target, drafter).pair_key  # the gate keeps them apart
    _mtp_equals_classic(loaded)


def test_quantizing_a_quantized_drafter_is_refused(ckpts):
    with pytest.raises(UsageError, match="already quantized"):
        load_pair(str(ckpts.target()), str(ckpts.drafter(bits=4)), draft_quantize=4)


def test_bad_draft_quantize_values_are_usage_errors(capsys):
    assert run(["generate", "-p", "x", "-n", "2", "--draft-quantize", "3"]) == 2
    assert "--draft-quantize must be 4 or 8" in capsys.readouterr().err
    assert run(["bench", "--draft-quantize", "2", "--repeats", "1", "-n", "2"]) == 2


def test_extract_quantized_from_a_sharded_source(ckpts, tmp_path):
    raw = ckpts.target(layout="raw", shards=2)
    assert (raw / "model.safetensors.index.json").is_file()
    out = extract_drafter(raw, tmp_path / "d4", quantize=4, group_size=32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert cfg["block_size"] == max(cfg["text_config"].get("mtp_num_hidden_layers", 1), 1) + 2
    target = load_target(ckpts.target(), load_config(ckpts.target()))
    q = load_drafter(out, load_config(out), target.embed_tokens).module
    ref_dir = extract_drafter(raw, tmp_path / "bf16")
    ref = _params(load_drafter(ref_dir, load_config(ref_dir), target.embed_tokens).module)
    layers = {k: m for k, m in q.named_modules() if hasattr(m, "scales")}
    assert sorted(k.split(".")[-1] for k in layers) == sorted(LINEARS)
    for path, layer in layers.items():
        w = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=4)
        r = ref[path + ".weight"].astype(mx.float32).reshape(-1, 32)
        err = mx.abs(w.astype(mx.float32).reshape(-1, 32) - r)
        # affine 4-bit: within one step of 15 across each group's range (MLX's quantizer puts
        # the bias on an exact end, so the far end may miss by most of a step) and bf16 rounding
        bound = (mx.max(r, axis=1) - mx.min(r, axis=1)) / 15 * 1.01 + 1e-3
        assert bool(mx.all(err <= bound[:, None]).item()), path
    loaded = load_pair(str(ckpts.target()), str(out))
    _mtp_equals_classic(loaded)


def test_extract_quantize_arguments_are_checked(ckpts, tmp_path, capsys):
    raw = str(ckpts.target(layout="raw"))
    assert run(["extract-drafter", raw, str(tmp_path / "a"), "--quantize", "3"]) == 2
    assert run(["extract-drafter", raw, str(tmp_path / "b"), "--quantize", "4", "--group-size",
                "48"]) == 2  # fmt: skip
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_extract_a_moe_head_equals_the_standalone_moe_drafter(ckpts, tmp_path):
    raw = ckpts.target(moe=True, layout="raw")
    out = extract_drafter(raw, tmp_path / "moe")
    target = load_target(ckpts.target(moe=True), load_config(ckpts.target(moe=True)))
    a = _params(load_drafter(out, load_config(out), target.embed_tokens).module)
    ref = ckpts.drafter(moe=True)
    b = _params(load_drafter(ref, load_config(ref), target.embed_tokens).module)
    assert a.keys() == b.keys() and any("switch_mlp" in k for k in a)
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_a_moe_head_stored_one_tensor_per_expert(ckpts, tmp_path):
    """Some releases store each expert apart (``experts.{i}.gate_proj.weight``): the same head."""
    raw = ckpts.target(moe=True, layout="raw")
    src = tmp_path / "per-expert"
    shutil.copytree(raw, src)
    tensors = dict(mx.load(str(src / "model.safetensors")))
    fused = [k for k in tensors if k.startswith("mtp.") and k.endswith("experts.gate_up_proj")]
    assert fused
    for key in fused:
        prefix = key[: -len(".gate_up_proj")]
        gate_up, down = tensors.pop(key), tensors.pop(f"{prefix}.down_proj")
        mid = gate_up.shape[-2] // 2
        for i in range(gate_up.shape[0]):
            tensors[f"{prefix}.{i}.gate_proj.weight"] = gate_up[i, :mid]
            tensors[f"{prefix}.{i}.up_proj.weight"] = gate_up[i, mid:]
            tensors[f"{prefix}.{i}.down_proj.weight"] = down[i]
    mx.save_safetensors(str(src / "model.safetensors"), tensors, metadata={"format": "pt"})
    target = load_target(ckpts.target(moe=True), load_config(ckpts.target(moe=True)))
    a = _params(load_drafter(extract_drafter(src, tmp_path / "a"), load_config(raw),
                             target.embed_tokens).module)  # fmt: skip
    b = _params(load_drafter(extract_drafter(raw, tmp_path / "b"), load_config(raw),
                             target.embed_tokens).module)  # fmt: skip
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


def _e4m3(code: int) -> float:
    """One E4M3FN code's value, from the format's definition (independent of the library's)."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def test_e4m3_values_match_the_format():
    got = np.array(e4m3_values())
    want = np.array([_e4m3(c) for c in range(256)])
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).sum() == 2
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok])
    assert (got[0x38], got[0x7E], got[0xB8], got[0x01]) == (1.0, 448.0, -1.0, 2.0**-9)


def _as_fp8(path: Path, names: set[str]) -> None:
    """Relabel ``names`` (saved by MLX as U8) as F8_E4M3 in a safetensors header."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    for k in names & header.keys():
        header[k]["dtype"] = "F8_E4M3"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _fp8_source(src: Path, dst: Path, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """A copy of the raw checkpoint ``src`` whose MTP linear weights are block FP8 (codes +
    ``weight_scale_inv``), as Hugging Face's FP8 releases store them; returns the values the
    extracted weights must hold."""
    shutil.copytree(src, dst)
    values = np.array([_e4m3(c) for c in range(256)])
    finite = np.where(~np.isnan(values))[0]
    expected, rng = {}, np.random.default_rng(0)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    files: dict[str, dict] = {}
    for f in sorted(set(index.values())):
        files[f] = dict(mx.load(str(dst / f)))
    for f, tensors in files.items():
        for name in [k for k in tensors if k.startswith("mtp.") and k.endswith(".weight")
                     and k.split(".")[-2] in LINEARS]:  # fmt: skip
            n, k = tensors[name].shape
            codes = rng.choice(finite, size=(n, k)).astype(np.uint8)
            scale = rng.uniform(0.001, 0.01, size=(-(-n // block[0]), -(-k // block[1])))
            scale = scale.astype(np.float32)
            tensors[name] = mx.array(codes)
            tensors[name + "_scale_inv"] = mx.array(scale)
            index[name + "_scale_inv"] = f
            full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:n, :k]
            expected[name] = values[codes] * full
        mx.save_safetensors(str(dst / f), tensors, metadata={"format": "pt"})
        _as_fp8(dst / f, {k for k, v in tensors.items() if v.dtype == mx.uint8})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    return expected


def test_extract_a_block_fp8_source(ckpts, tmp_path, capsys):
    src = tmp_path / "fp8"
    expected = _fp8_source(ckpts.target(layout="raw", shards=2), src, (8, 16))
    assert run(["inspect-weights", str(src), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "F8_E4M3" in info["dtypes"]
    with pytest.raises(BadConfigError, match="block-FP8"):
        load_pair(str(src))
    assert run(["extract-drafter", str(src), str(tmp_path / "d")]) == 0
    got = load_arrays(tmp_path / "d")
    assert len(expected) == len(LINEARS)
    for name, want in expected.items():
        w = np.array(got[name[len("mtp.") :]].astype(mx.float32))
        bf16 = np.array(mx.array(want.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))
        assert np.array_equal(w, bf16), name
    loaded = load_pair(str(ckpts.target()), str(tmp_path / "d"))
    _mtp_equals_classic(loaded, n=16)


def test_a_bad_fp8_block_size_is_a_named_error(ckpts, tmp_path):
    src = tmp_path / "fp8"
    _fp8_source(ckpts.target(layout="raw", shards=2), src, (8, 16))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [8, 8]  # not what the scales were made for
    (src / "config.json").write_text(json.dumps(cfg))
    assert run(["extract-drafter", str(src), str(tmp_path / "d")]) == 1
    assert not (tmp_path / "d").exists()


def test_bench_runs_quantized_drafters_beside_the_bf16_one(ckpts):
    loaded = load_pair(str(ckpts.target()), str(ckpts.drafter()))
    from mtpcli.drafters.qwen3_5_mtp import quantized_copy

    q4 = quantized_copy(loaded.drafter, 4)
    assert loaded.drafter.config.quantization is None  # the original is left as it was
    result = bench.compare(loaded.target, loaded.drafter, PROMPTS, blocks=[3], max_tokens=16,
                           repeats=1, quantized={4: q4})  # fmt: skip
    assert result["mtp-3-q4"]["name"] == "mtp block 3, 4-bit drafter"
    assert result["mtp-3-q4"]["same_tokens_as_classic"] is True
    assert result["mtp-3"]["same_tokens_as_classic"] is True
    doc = bench.to_json(result, None, {}, {})
    assert set(doc["mtp_tps"]) == {"3", "3-q4"}
