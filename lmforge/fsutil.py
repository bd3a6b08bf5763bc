"""Writes that never leave a half-written result under the final name."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from lmforge.errors import UserError


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary sibling renamed over it: a reader (or a crash) sees the
    old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it is renamed to `final`.

    On any exception the temporary directory is removed and `final` is untouched.
    """
    final = Path(final)
    if final.exists() and not overwrite and (final.is_file() or any(final.iterdir())):
        raise UserError(f"output '{final}' already exists and is not empty: choose another path or pass --overwrite")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
