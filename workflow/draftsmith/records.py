"""Records one stage writes and another reads: one type each, used by both sides.

- ``RowIds``: the question id of each dataset row (``dataset/row_ids.json``; prepare-data drops
  the ids), written by the dataset stage, read by training's messages and fingerprint.
- ``ShardManifest``: what an extraction shard holds (``hidden_states/shard_<i>/manifest.json``),
  read by the training view (how many rows are stored) and fingerprinted by training.
- ``TrainingMetrics``: what training did (``drafter/training_metrics.json``), read by the
  report's training curves and the bench.
- ``Measurement``: one evaluation job (``eval/baseline.json``, ``eval/drafter_k<k>.json``):
  its ``Phase``s, each with a ``Tally`` per prompt category, read by the evaluation summary.

A record reads back what its writer wrote (``from_json(to_json(r)) == r``); a file from
before a field existed reads with that field's default, so finished runs stay readable.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

from draftsmith.atomic import atomic_write_text
from draftsmith.layout import CAPTURED_ROWS, ROW_IDS, SHARD_MANIFEST, TRAINING_METRICS


class _Record:
    """JSON in and out for a dataclass record; unknown keys in a file are an error."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls(**json.loads(text))


class _FileRecord(_Record):
    """A record kept as one named file in a stage's output directory."""

    FILE_NAME: ClassVar[str]

    def write(self, directory: Path) -> None:
        atomic_write_text(directory / self.FILE_NAME, self.to_json())

    @classmethod
    def read(cls, directory: Path) -> Self | None:
        path = directory / cls.FILE_NAME
        return cls.from_json(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class RowIds:
    """Row -> question id of a prepared dataset: a JSON list, in row order, each id once."""

    ids: list[str]

    def write(self, dataset: Path) -> None:
        atomic_write_text(dataset / ROW_IDS, json.dumps(self.ids) + "\n")

    @classmethod
    def read(cls, dataset: Path) -> RowIds | None:
        path = dataset / ROW_IDS
        return cls(json.loads(path.read_text())) if path.is_file() else None


@dataclass(frozen=True)
class CapturedRows(_FileRecord):
    """One pass: the dataset's leading ``captured`` rows had their states saved by the
    generation server (``dataset/captured_rows.json``; the dataset puts them first). A disk
    budget stores at most these; the extraction stage adopts their files."""

    FILE_NAME: ClassVar[str] = CAPTURED_ROWS
    captured: int
    rows: int


@dataclass(frozen=True)
class ShardManifest(_FileRecord):
    FILE_NAME: ClassVar[str] = SHARD_MANIFEST
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
    # One pass: rows by how they got their states (adopted from generation, or requested
    # by prefill and why); None for a separate extraction.
    captured_during_generation: dict[str, int] | None = None


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


@dataclass
class Tally:
    """What some requests produced: tokens, their own latencies, and (with a drafter) the
    summed acceptance histogram, ``histogram[j]`` = verify steps that accepted ``j`` tokens."""

    requests: int = 0
    completion_tokens: int = 0
    request_seconds: float = 0.0
    histogram: list[int] = field(default_factory=list)
    draft_tokens: int = 0
    # Sums of each request's own speed (tokens / its latency) and of its square: they add up
    # over phases and sets like the counts do, and give the measurement its spread.
    speed_sum: float = 0.0
    speed_squares: float = 0.0

    def add(self, response: dict[str, Any], seconds: float) -> None:
        tokens = response["usage"]["completion_tokens"]
        self.requests += 1
        self.completion_tokens += tokens
        self.request_seconds += seconds
        if seconds > 0:
            self.speed_sum += tokens / seconds
            self.speed_squares += (tokens / seconds) ** 2
        spec = (response.get("metrics") or {}).get("speculative_decoding")
        if spec:
            self.histogram = summed(self.histogram, spec["acceptance_histogram"])
            self.draft_tokens += spec["num_draft_tokens"]


def summed(a: list[int], b: list[int]) -> list[int]:
    return [(a[j] if j < len(a) else 0) + (b[j] if j < len(b) else 0) for j in range(max(len(a), len(b)))]


@dataclass
class Phase:
    """One prompt set sent at one concurrency and one sampling."""

    set: str
    concurrency: int
    sampling: dict[str, Any]
    seconds: float = 0.0
    categories: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))

    @property
    def temperature(self) -> float:
        return float(self.sampling.get("temperature", 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "set": self.set,
            "concurrency": self.concurrency,
            "sampling": self.sampling,
            "seconds": self.seconds,
            "categories": {name: dataclasses.asdict(tally) for name, tally in sorted(self.categories.items())},
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Phase:
        categories = {name: Tally(**tally) for name, tally in values["categories"].items()}
        return cls(values["set"], values["concurrency"], values["sampling"], values["seconds"], categories)


@dataclass(frozen=True)
class Measurement(_Record):
    """One evaluation job: the target alone (``method`` None), with a drafter or with a
    method that needs none at ``num_speculative_tokens``, every phase, and the server's own
    spec-decode counters."""

    drafter: str | None
    num_speculative_tokens: int | None
    phases: list[Phase]
    server_counters: dict[str, int]
    mla_disabled: bool
    mla_disabled_because: str | None = None  # written only when MLA was disabled
    # vLLM's speculative method; None in the baseline's, and in drafter jobs from before
    # free methods were measured (``speculative_method`` reads those as eagle3).
    method: str | None = None
    # The kind of drafter (training.kinds) when not EAGLE-3's: P-EAGLE is served by vLLM's
    # eagle3 method, so the method alone does not tell the kinds apart.
    kind: str | None = None

    @property
    def speculative_method(self) -> str | None:
        return self.method or ("eagle3" if self.drafter else None)

    @property
    def name(self) -> str | None:
        """What the report calls it: the kind of drafter, or the method."""
        return self.kind or self.speculative_method

    def to_json(self) -> str:
        values: dict[str, Any] = {
            "drafter": self.drafter,
            "num_speculative_tokens": self.num_speculative_tokens,
            "phases": [phase.to_dict() for phase in self.phases],
            "server_counters": self.server_counters,
            "mla_disabled": self.mla_disabled,
        }
        if self.mla_disabled_because is not None:
            values["mla_disabled_because"] = self.mla_disabled_because
        if self.method is not None:
            values["method"] = self.method
        if self.kind is not None:
            values["kind"] = self.kind
        return json.dumps(values, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Measurement:
        values = json.loads(text)
        return cls(**(values | {"phases": [Phase.from_dict(phase) for phase in values["phases"]]}))

    @classmethod
    def read(cls, path: Path) -> Measurement:
        return cls.from_json(path.read_text())
