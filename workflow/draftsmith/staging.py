"""Staged partial work is reused only if it was made the same way.

Stages keep finished items in ``results/.staging/...`` so a crash loses little. But a
rerun caused by a changed setting (another max_tokens, other layers) must not pick up
items made under the old one: each staging directory records the fingerprint of
the settings that shape its items (``settings.item_settings``), and a mismatch sets the
old items aside. Items are named by question id or dataset row, not by shard, so after
a re-sharding a shard takes the items it needs from its siblings made the same way.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_write_text
from draftsmith.layout import SHARD_GLOB
from draftsmith.progress import log

FINGERPRINT = "fingerprint.json"


def fingerprint_of(shaping: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()


def open_staging(staging: Path, shaping: dict[str, Any]) -> Path:
    """Create ``staging`` for work shaped by ``shaping``; stale work is moved aside, not reused."""
    expected = fingerprint_of(shaping)
    marker = staging / FINGERPRINT
    if staging.exists():
        if recorded_fingerprint(staging) != expected:
            stale = staging.with_name(f"{staging.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
            log(f"settings changed since the work staged in {staging}; moving it to {stale}")
            staging.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir(parents=True, exist_ok=True)
    if not marker.exists():
        atomic_write_text(marker, json.dumps({"fingerprint": expected, "settings": shaping}, indent=2) + "\n")
    return staging


def recorded_fingerprint(staging: Path) -> str | None:
    marker = staging / FINGERPRINT
    return json.loads(marker.read_text())["fingerprint"] if marker.is_file() else None


def matching_siblings(staging: Path) -> list[Path]:
    """The other shards' staging directories of this stage whose items were made under the
    same settings as this one's (after ``open_staging``)."""
    mine = recorded_fingerprint(staging)
    return [
        sibling
        for sibling in sorted(staging.parent.glob(SHARD_GLOB))
        if sibling != staging and recorded_fingerprint(sibling) == mine
    ]
