"""The built-in example: a tiny qwen3_5 target + qwen3_5_mtp drafter, written on first use.

It is loaded through exactly the same code as a real checkpoint. Its weights are random
(shaped so that drafts are often accepted), so its text is noise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

EXAMPLE_VERSION = 2  # 2: the vision stand-in in its 5-D layout
NOTE = "built-in example: a tiny random-weight model, so the text is noise"


def cache_dir() -> Path:
    if os.environ.get("MTP_CACHE_DIR"):
        return Path(os.environ["MTP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mtp"


def ensure_example() -> tuple[Path, Path]:
    """Paths of the example target and drafter, writing them first if needed."""
    from .fixtures import write_pair

    root = cache_dir() / f"example-v{EXAMPLE_VERSION}"
    if not (root / "ready").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".example-"))
        write_pair(tmp, predictable=0.45)
        (tmp / "ready").write_text("ok\n")
        shutil.rmtree(root, ignore_errors=True)
        try:
            tmp.rename(root)
        except OSError:  # another process won the race; theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
    return root / "target", root / "drafter"
