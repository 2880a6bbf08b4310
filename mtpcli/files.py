"""Reading files a user hands us, and writing a directory all at once.

A checkpoint directory is untrusted input: a config may be a FIFO (reading it blocks forever),
a link to /dev/zero (reading it never ends), a directory, or unreadable. Every file is checked
to be a regular file of a bounded size before it is opened, and each failure names its cause.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import BadConfigError, MtpError, OutputError

# Real configs are a few KiB, tokenizer.json of a 248k vocabulary about 20 MiB.
MAX_JSON_BYTES = 64 << 20


def why(e: OSError) -> str:
    """The cause an OSError names, in words (never a guess at another cause)."""
    return e.strerror or os.strerror(e.errno or 0) or type(e).__name__


def regular_file(
    path: Path, what: str, error: type[MtpError] = BadConfigError, limit: int | None = None
) -> Path:
    """``path``, if it is a regular file (of at most ``limit`` bytes); else ``error`` saying
    what it is instead."""
    try:
        st = path.stat()  # follows links: a link to a FIFO is a FIFO
    except FileNotFoundError as e:
        dangling = " (a dangling link)" if path.is_symlink() else ""
        raise error(f"no {what} at {path}{dangling}") from e
    except OSError as e:
        raise error(f"cannot read the {what} {path}: {why(e)}") from e
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path} is a directory, expected the {what} file")
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device, socket or other special file"
        raise error(f"the {what} {path} is {kind}, not a regular file")
    if limit is not None and st.st_size > limit:
        raise error(f"the {what} {path} is larger than {limit >> 20} MiB; no real one is")
    return path


def read_bounded(
    path: Path, what: str, limit: int = MAX_JSON_BYTES, error: type[MtpError] = BadConfigError
) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    regular_file(path, what, error, limit)
    try:
        # O_NONBLOCK: were the file swapped for a FIFO after the check, open would not block.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise error(f"the {what} {path} is not a regular file")
            data = f.read(limit + 1)
    except OSError as e:
        raise error(f"cannot read the {what} {path}: {why(e)}") from e
    if len(data) > limit:
        raise error(f"the {what} {path} is larger than {limit >> 20} MiB; no real one is")
    return data


def readable_dir(path: Path, what: str, error: type[MtpError]) -> Path:
    """``path``, if it is a directory this process may list and open files in."""
    try:
        os.listdir(path)
    except NotADirectoryError as e:
        raise error(f"{what} {path} is a file; pass the checkpoint's directory") from e
    except OSError as e:
        raise error(f"cannot read the {what} directory {path}: {why(e)}") from e
    return path


def check_output_dir(out: Path) -> Path:
    """``out``, if a directory can be written there: absent, or an empty directory."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"{out} exists and is not a directory; choose a new output directory")
    if out.exists() and any(out.iterdir()):
        raise OutputError(f"{out} exists and is not empty; choose a new output directory")
    return out


def writable_dir(out: Path) -> Path:
    """``out`` as a directory results can be written to, made with its parents and shown
    writable by writing there, before any work whose results would otherwise be lost."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory; give a directory for the results")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".mtp-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"cannot write the results under {out}: {why(e)}") from e
    return out


@contextlib.contextmanager
def written_dir(out: Path) -> Iterator[Path]:
    """Write a directory all at once: yields a temporary sibling, renamed to ``out`` only when
    the block finishes. On any error or interrupt the sibling is removed and ``out`` never
    exists half-written."""
    parent = check_output_dir(out).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.partial-"))
    except OSError as e:
        raise OutputError(f"cannot write under {parent}: {why(e)}") from e
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except OSError as e:
        raise OutputError(f"cannot write {out}: {why(e)}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
