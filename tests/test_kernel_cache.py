"""scripts/kernel_cache.sh: a machine's compiled kernels saved, and restored on the next."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kernel_cache.sh"


def _run(what: str, archive: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(_SCRIPT), what, str(archive)], env=env,
                          capture_output=True, text=True)  # fmt: skip


@pytest.fixture
def machine(tmp_path) -> dict:
    """The environment of a stand-in machine whose caches live under tmp_path."""
    python = Path(sys.executable).parent
    return os.environ | {"MLX_PTX_CACHE_DIR": str(tmp_path / "ptx"),
                         "CUDA_CACHE_PATH": str(tmp_path / "nv"),
                         "PATH": f"{python}:{os.environ['PATH']}"}  # fmt: skip


def test_saved_kernels_come_back_on_a_fresh_machine(tmp_path, machine):
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "mtp_qmm_4.ptx").write_text("ptx of a kernel")
    (tmp_path / "nv" / "sub").mkdir(parents=True)
    (tmp_path / "nv" / "sub" / "index").write_text("driver cache")
    archive = tmp_path / "kernels.tgz"
    saved = _run("save", archive, machine)
    assert saved.returncode == 0 and "saved 1 MLX and 1 driver files" in saved.stdout
    fresh = machine | {"MLX_PTX_CACHE_DIR": str(tmp_path / "new" / "ptx"),
                       "CUDA_CACHE_PATH": str(tmp_path / "new" / "nv")}  # fmt: skip
    back = _run("restore", archive, fresh)
    assert back.returncode == 0, back.stderr
    assert (tmp_path / "new" / "ptx" / "mtp_qmm_4.ptx").read_text() == "ptx of a kernel"
    assert (tmp_path / "new" / "nv" / "sub" / "index").read_text() == "driver cache"


def test_a_cache_of_another_mlx_or_a_bad_call_is_refused(tmp_path, machine):
    stage = tmp_path / "stage"
    (stage / "ptx").mkdir(parents=True)
    (stage / "driver").mkdir()
    (stage / "ptx" / "k.ptx").write_text("old")
    (stage / "mlx_version").write_text("0.0.1\n")
    archive = tmp_path / "old.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(stage, arcname=".")
    refused = _run("restore", archive, machine)
    assert refused.returncode == 1 and "is for MLX 0.0.1" in refused.stderr
    assert not (tmp_path / "ptx" / "k.ptx").exists()
    assert _run("keep", archive, machine).returncode == 2


def test_a_cache_saved_in_parts_comes_back_from_its_parts(tmp_path, machine):
    """Saved in parts of a given size (a device tool that returns files of limited size), the
    cache is restored from the parts; with neither archive nor parts, a named error."""
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "k.ptx").write_bytes(os.urandom(3000))  # incompressible: 3+ parts
    archive = tmp_path / "out" / "kernels.tgz"
    archive.parent.mkdir()
    saved = subprocess.run(["bash", str(_SCRIPT), "save", str(archive), "1k"], env=machine,
                           capture_output=True, text=True)  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    parts = sorted(archive.parent.glob("kernels.tgz.part-*"))
    assert len(parts) >= 3 and not archive.exists()
    assert all(p.stat().st_size <= 1024 for p in parts)
    fresh = machine | {"MLX_PTX_CACHE_DIR": str(tmp_path / "new" / "ptx")}
    back = _run("restore", archive, fresh)
    assert back.returncode == 0, back.stderr
    assert (tmp_path / "new" / "ptx" / "k.ptx").read_bytes() == (
        tmp_path / "ptx" / "k.ptx"
    ).read_bytes()
    missing = _run("restore", tmp_path / "none.tgz", fresh)
    assert missing.returncode == 1 and "no kernel cache" in missing.stderr
    restore_in_parts = subprocess.run(["bash", str(_SCRIPT), "restore", str(archive), "1k"],
                                      env=machine, capture_output=True, text=True)  # fmt: skip
    assert restore_in_parts.returncode == 2
