"""How norms are stored, decided from the files' evidence: each piece alone, pieces that
disagree, and extract-drafter on a raw checkpoint and on an MLX conversion that kept its head
(the double-shift hazard)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mtpcli import extract, layout
from mtpcli.cli import run
from mtpcli.config import load_config
from mtpcli.drafters.qwen3_5_mtp import load_drafter
from mtpcli.errors import BadCheckpointError, LayoutError
from mtpcli.extract import extract_drafter
from mtpcli.fixtures import (
    build_drafter,
    build_target,
    is_norm_or_dt_bias,
    tiny_text_config,
    write_target,
)
from mtpcli.layout import MLX, RAW, Evidence, stores_w_minus_1
from mtpcli.models.qwen3_5 import load_target
from mtpcli.weights import read_format, read_inventory, sanitize_drafter


def _retag(path: Path, tag: str | None) -> None:
    """Rewrite one safetensors file with another ``format`` tag (None: no tag)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.eval(arrays)
    meta = {k: v for k, v in meta.items() if k != "format"} | ({"format": tag} if tag else {})
    mx.save_safetensors(str(path), arrays, metadata=meta)


# --- each piece of evidence alone ---------------------------------------------------------


@pytest.mark.parametrize("tags,says", [
    ({"a": "pt"}, RAW), ({"a": "mlx", "b": "mlx"}, MLX), ({"a": None}, None),
    ({"a": "pt", "b": "mlx"}, None), ({"a": "pt", "b": None}, None), ({"a": "np"}, None),
])  # fmt: skip
def test_format_tag(tags, says):
    assert layout.format_tag(tags).says == says


@pytest.mark.parametrize("names,says", [
    (["model.language_model.norm.weight", "mtp.fc.weight"], RAW),
    (["language_model.model.norm.weight", "mtp.fc.weight"], MLX),
    (["model.norm.weight", "mtp.fc.weight"], None),
    (["model.language_model.norm.weight", "language_model.model.norm.weight"], None),
])  # fmt: skip
def test_tensor_names(names, says):
    assert layout.tensor_names(names).says == says


@pytest.mark.parametrize("shapes,says", [
    ({"a.conv1d.weight": (96, 1, 4)}, RAW), ({"a.conv1d.weight": (96, 4, 1)}, MLX),
    ({"a.conv1d.weight": (96, 1, 4), "b.conv1d.weight": (96, 4, 1)}, None), ({}, None),
])  # fmt: skip
def test_conv1d_layout(shapes, says):
    assert layout.conv1d_layout(shapes).says == says


@pytest.mark.parametrize("centre,says", [(0.0, RAW), (1.0, MLX), (0.5, None), (2.0, None)])
def test_norm_values(centre, says):
    noise = mx.random.uniform(-0.2, 0.2, (64,), key=mx.random.key(0))
    norms = {"a.norm.weight": centre + noise, "b.norm.weight": centre - noise}
    assert layout.norm_values(norms).says == says
    assert layout.norm_values({}).says is None


@pytest.mark.parametrize("source", ["format tag", "tensor names", "conv1d layout", "norm values"])
@pytest.mark.parametrize("says", [RAW, MLX])
def test_one_piece_of_evidence_decides_alone(source, says):
    quiet = [Evidence(s, None, "-") for s in ("format tag", "tensor names") if s != source]
    assert stores_w_minus_1([Evidence(source, says, "-"), *quiet], "x") == (says == RAW)


def test_no_evidence_is_refused_not_guessed():
    with pytest.raises(LayoutError, match="cannot tell whether x stores"):
        stores_w_minus_1([Evidence("format tag", None, "no tag")], "x")


@pytest.mark.parametrize("other", ["tensor names", "conv1d layout", "norm values"])
def test_disagreeing_evidence_is_refused_naming_both(other):
    ev = [Evidence("format tag", RAW, "tag 'pt'"), Evidence(other, MLX, "looks converted")]
    with pytest.raises(LayoutError, match=f"format tag: tag 'pt' -> raw; {other}:"):
        stores_w_minus_1(ev, "x")


# --- on checkpoints --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def head():
    text = tiny_text_config()
    return text, build_target(text, seed=3), build_drafter(text, seed=4)


def _standalone(module) -> dict[str, mx.array]:
    return dict(tree_flatten(module.parameters()))


def _extracted(src: Path, out: Path) -> dict[str, mx.array]:
    extract_drafter(src, out)
    return dict(mx.load(str(out / "model.safetensors")))


def _same(a: dict[str, mx.array], b: dict[str, mx.array]) -> bool:
    return a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.parametrize("layout_", ["raw", "mlx"])
def test_extract_shifts_a_raw_head_once_and_a_converted_head_never(head, tmp_path, layout_):
    text, model, drafter = head
    src = write_target(tmp_path / "src", text, layout=layout_, model=model, drafter=drafter)
    assert read_format(next(src.glob("*.safetensors"))) == ("pt" if layout_ == "raw" else "mlx")
    assert _same(_extracted(src, tmp_path / "out"), _standalone(drafter))


def test_a_double_shift_fails_the_extract_test(head, tmp_path, monkeypatch):
    """Mutation: a converted head shifted as if raw (the hazard) is caught."""
    text, model, drafter = head
    src = write_target(tmp_path / "src", text, layout="mlx", model=model, drafter=drafter)
    monkeypatch.setattr(extract, "sanitize_drafter", lambda t, shift: sanitize_drafter(t, True))
    assert not _same(_extracted(src, tmp_path / "out"), _standalone(drafter))


def test_extract_refuses_a_raw_checkpoint_tagged_as_mlx(head, tmp_path):
    text, model, drafter = head
    src = write_target(tmp_path / "src", text, layout="raw", model=model, drafter=drafter)
    _retag(src / "model.safetensors", "mlx")
    with pytest.raises(LayoutError, match="format tag.*-> mlx.*tensor names.*-> raw"):
        extract_drafter(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_extract_refuses_a_converted_head_whose_norms_look_raw(head, tmp_path):
    """Tags and names say MLX, the head's norm values centre on 0: refused, not guessed."""
    text, model, drafter = head
    raw_head = build_drafter(text, seed=4)
    raw_head.update(tree_unflatten([(k, v - 1.0) for k, v in tree_flatten(raw_head.parameters())
                                    if is_norm_or_dt_bias(k, v)]))  # fmt: skip
    src = write_target(tmp_path / "src", text, layout="mlx", model=model, drafter=raw_head)
    code = run(["extract-drafter", str(src), str(tmp_path / "out")])
    assert code == 1 and not (tmp_path / "out").exists()


def test_target_load_refuses_contradicting_evidence(head, tmp_path):
    text, model, drafter = head
    src = write_target(tmp_path / "src", text, layout="raw", model=model, drafter=drafter)
    load_target(src, load_config(src))  # consistent: loads
    _retag(src / "model.safetensors", "mlx")
    with pytest.raises(LayoutError, match="disagrees"):
        load_target(src, load_config(src))


def test_a_shard_the_index_does_not_name_is_reported(head, tmp_path):
    """The mtp.* tensors in a file the index forgot: named, with what is wrong."""
    text, model, drafter = head
    src = write_target(tmp_path / "src", text, layout="raw", model=model, drafter=drafter,
                       shards=3)  # fmt: skip
    index = json.loads((src / "model.safetensors.index.json").read_text())
    mtp_file = index["weight_map"]["mtp.fc.weight"]
    moved = {k: v for k, v in mx.load(str(src / mtp_file)).items() if k.startswith("mtp.")}
    kept = {k: v for k, v in mx.load(str(src / mtp_file)).items() if not k.startswith("mtp.")}
    mx.eval(moved, kept)
    mx.save_safetensors(str(src / mtp_file), kept, metadata={"format": "pt"})
    mx.save_safetensors(str(src / "mtp.safetensors"), moved, metadata={"format": "pt"})
    for k in moved:
        del index["weight_map"][k]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BadCheckpointError, match=r"mtp\.safetensors holds 15 tensor\(s\).*does not"
                                                 " name that file"):  # fmt: skip
        read_inventory(src)
    with pytest.raises(BadCheckpointError, match="mtp.safetensors"):
        extract_drafter(src, tmp_path / "out")
    assert run(["inspect-weights", str(src)]) == 1


def test_tensors_a_named_shard_holds_but_the_index_omits_are_reported(head, tmp_path):
    text, model, drafter = head
    src = write_target(tmp_path / "src", text, layout="raw", model=model, drafter=drafter,
                       shards=2)  # fmt: skip
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["mtp.fc.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BadCheckpointError, match="does not list, e.g. mtp.fc.weight"):
        read_inventory(src)


def test_extracted_drafter_loads_and_equals_the_head(head, tmp_path):
    text, model, drafter = head
    src = write_target(tmp_path / "src", text, layout="raw", model=model, drafter=drafter)
    out = extract_drafter(src, tmp_path / "out")
    target = load_target(src, load_config(src))
    loaded = load_drafter(out, load_config(out), target.embed_tokens).module
    assert _same(_standalone(loaded), _standalone(drafter))
