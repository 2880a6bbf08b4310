"""scripts/gdn_variants/make_variants.py's spliced variants still apply to the product's kernel
file: a splice whose text the kernel lost would otherwise surface only on the GPU, after the
install, as a skipped variant."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mtpcli.kernels import gated_delta as gd

_DIR = Path(__file__).resolve().parents[1] / "scripts" / "gdn_variants"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mv = _load("make_variants", _DIR / "make_variants.py")
NAMES = sorted(mv.SPLICED) + ["onebfly"]


@pytest.mark.parametrize("name", NAMES)
def test_a_variant_applies_and_changes_the_conv_kernel(tmp_path, name):
    path = tmp_path / f"gd_{name}.py"
    path.write_text(mv.variant(name))
    v = _load(f"mtpcli.kernels.gd_{name}", path)
    for keep in (False, True):
        source = v._source(False, keep, True, conv=True)
        assert "PIPE_GUARD" not in source and "KEEP_STATES" not in source
    # ko_keep only touches the kept states' stores; every variant changes that kernel
    assert v._source(False, True, True, conv=True) != gd._source(False, True, True, conv=True)


def test_a_splice_the_kernel_lost_is_refused(monkeypatch):
    monkeypatch.setitem(mv.SPLICED, "gone", [("no such kernel line;", "")])
    with pytest.raises(SystemExit, match="not found"):
        mv.variant("gone")


def test_a_knock_out_skips_the_self_check_and_a_candidate_keeps_it(tmp_path):
    """A knock-out's outputs are wrong by design, so --step must run it unchecked; a
    candidate keeps the product's self-check."""
    for name, skipped in (("ko_keep", True), ("ko_qk1keep", True), ("na2", False)):
        text = mv.variant(name)
        assert ("def _self_check_conv(*args, **kwargs)" in text) == skipped
        path = tmp_path / f"gd_{name}.py"
        path.write_text(text)
        v = _load(f"mtpcli.kernels.gd_{name}_check", path)
        co = v._self_check_conv.__code__
        assert (co.co_argcount == 0 and co.co_flags & 0x0C == 0x0C) == skipped
        assert getattr(v, "KNOCKOUT", False) is skipped
    assert v._self_check_conv.__code__.co_varnames[:4] == ("dtype", "heads", "K", "w_dtype")
