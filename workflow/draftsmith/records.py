"""Records one stage writes and another reads: one type each, used by both sides.

- ``ShardManifest``: what an extraction shard holds (``hidden_states/shard_<i>/manifest.json``),
  read by the training view (how many rows are stored) and fingerprinted by training.
- ``TrainingMetrics``: what training did (``drafter/training_metrics.json``), read by the
  report's training curves and the bench.

A record reads back what its writer wrote (``from_json(to_json(r)) == r``); a file from
before a field existed reads with that field's default, so finished runs stay readable.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from draftsmith.atomic import atomic_write_text
from draftsmith.layout import SHARD_MANIFEST, TRAINING_METRICS


class _Record:
    """JSON in and out for a dataclass record; unknown keys in a file are an error."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class ShardManifest(_Record):
    items_fingerprint: str  # the settings every file was made under (settings.item_settings)
    rows: list[int]  # [first, past the last] dataset row of the shard
    num_rows: int
    config_layers: list[int]
    vllm_layer_ids: list[int]
    num_layers: int
    hidden_size: int
    dtype: str  # as stored: the served dtype, or float8_e4m3fn (hidden_states.stored_dtype)
    num_tokens: int
    bytes: int
    # Rows stored by all shards together (the training view covers 0..stored_rows-1);
    # None in manifests from before disk budgets, which stored every row.
    stored_rows: int | None = None

    def write(self, shard: Path) -> None:
        atomic_write_text(shard / SHARD_MANIFEST, self.to_json())

    @classmethod
    def read(cls, shard: Path) -> ShardManifest | None:
        path = shard / SHARD_MANIFEST
        return cls.from_json(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class TrainingMetrics(_Record):
    published_epoch: int | None  # None: the untrained drafter
    # Per epoch: {"epoch", "steps", "train": {metric: mean}, "val": {metric: value}}
    epochs: list[dict[str, Any]] = field(default_factory=list)
    # Where the rows came from, when training ran: stored, captured in every epoch, and the
    # capture server's own count of the requests it answered.
    rows_stored: int | None = None
    rows_captured_per_epoch: int | None = None
    capture_requests: int | None = None

    def write(self, drafter: Path) -> None:
        atomic_write_text(drafter / TRAINING_METRICS, self.to_json())

    @classmethod
    def read(cls, drafter_or_file: Path) -> TrainingMetrics:
        path = drafter_or_file / TRAINING_METRICS if drafter_or_file.is_dir() else drafter_or_file
        return cls.from_json(path.read_text())
