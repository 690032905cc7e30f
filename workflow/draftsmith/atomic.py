"""Publish files and directories whole or not at all.

A crash must never leave a truncated file under a name the next stage trusts:
everything is written beside its final name and renamed into place (rename is
atomic on one filesystem).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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


def publish_directory(staged: Path, final: Path) -> None:
    """Move a finished directory to its final name; a stale one there is replaced."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        shutil.rmtree(final)
    os.rename(staged, final)
