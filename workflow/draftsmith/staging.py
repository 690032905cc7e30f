"""Staged partial work is reused only if it was made the same way.

Stages keep finished items in ``results/.staging/...`` so a crash loses little. But a
rerun caused by a changed setting (another max_tokens, other layers) must not pick up
items made under the old one: each staging directory records the fingerprint of
the settings that shape its items, and a mismatch sets the old items aside.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from draftsmith.atomic import atomic_write_text
from draftsmith.progress import log

FINGERPRINT = "fingerprint.json"


def fingerprint_of(shaping: dict) -> str:
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()


def open_staging(staging: Path, shaping: dict) -> Path:
    """Create ``staging`` for work shaped by ``shaping``; stale work is moved aside, not reused."""
    expected = fingerprint_of(shaping)
    marker = staging / FINGERPRINT
    if staging.exists():
        recorded = json.loads(marker.read_text())["fingerprint"] if marker.exists() else None
        if recorded != expected:
            stale = staging.with_name(f"{staging.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
            log(f"settings changed since the work staged in {staging}; moving it to {stale}")
            staging.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir(parents=True, exist_ok=True)
    if not marker.exists():
        atomic_write_text(marker, json.dumps({"fingerprint": expected, "settings": shaping}, indent=2) + "\n")
    return staging
