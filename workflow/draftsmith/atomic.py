"""Publish files and directories whole or not at all.

A crash must never leave a truncated file under a name the next stage trusts:
everything is written beside its final name and renamed into place (rename is
atomic on one filesystem).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
from pathlib import Path

_RENAME_EXCHANGE = 2  # linux/fs.h
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with partial.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)  # a full disk must not keep half a copy on it
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the
    kernel or filesystem cannot. Python's os module has no binding for it."""
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd = -100  # AT_FDCWD
    return renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def publish_directory(staged: Path, final: Path) -> None:
    """Give a finished directory its final name; one already there is replaced whole.

    A reader (or a crash) sees the old directory or the new one, never none or a mix:
    the two are swapped in one step, then the old one is removed. Where the filesystem
    cannot swap, the old one is renamed aside first (a crash there leaves it beside
    the final name, ``.<name>.replaced``, not lost)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if not final.exists():
        os.rename(staged, final)
        return
    if _exchange(staged, final):
        shutil.rmtree(staged)  # now holds the old contents
        return
    aside = final.with_name(f".{final.name}.replaced")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(final, aside)
    os.rename(staged, final)
    shutil.rmtree(aside)
