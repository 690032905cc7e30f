"""Records one stage writes and another reads: one type each, used by both sides.

- ``RowIds``: the question id of each dataset row (``dataset/row_ids.json``; prepare-data drops
  the ids), written by the dataset stage, read by training's messages and fingerprint.
- ``ShardManifest``: what an extraction shard holds (``hidden_states/shard_<i>/manifest.json``),
  read by the training view (how many rows are stored) and fingerprinted by training.
- ``TrainingMetrics``: what training did (``drafter/training_metrics.json``), read by the
  report's training curves and the bench.
- ``Measurement``: one evaluation job (``eval/baseline.json``, ``eval/drafter_k<k>.json``):
  its ``Phase``s, each with a ``Tally`` per prompt category, read by the evaluation summary.
- ``EvaluationSummary``: what the evaluation found and recommends (``eval/acceptance.json``),
  written by the evaluation summary, read by its report, the serve command and the bench.

A record reads back what its writer wrote (``from_json(to_json(r)) == r``); a file from
before a field existed reads with that field's default, so finished runs stay readable.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

from draftsmith.atomic import atomic_write_text
from draftsmith.drafter_kinds import DEFAULT_KIND, START_METHOD
from draftsmith.errors import DraftsmithError
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
    # The drafter training started from (training.from_pretrained), in words; None: from scratch.
    started_from: str | None = None
    # Trainable positions of speculators' validation split (the last rows): the noise of full_acc_i.
    validation_positions: int | None = None

    @property
    def published_validation(self) -> dict[str, float]:
        """The published epoch's validation metrics (empty for the untrained drafter)."""
        return next((e["val"] for e in self.epochs if e["epoch"] == self.published_epoch), {})

    def expected_per_position(self, k: int) -> list[float] | None:
        """What validation predicts served greedy acceptance to be at each of k positions."""
        validation = self.published_validation
        if any(f"full_acc_{i}" not in validation for i in range(k)):
            return None
        return [round(validation[f"full_acc_{i}"], 4) for i in range(k)]

    def write(self, drafter: Path) -> None:
        atomic_write_text(drafter / TRAINING_METRICS, self.to_json())

    @classmethod
    def read(cls, drafter_or_file: Path) -> TrainingMetrics:
        path = drafter_or_file / TRAINING_METRICS if drafter_or_file.is_dir() else drafter_or_file
        return cls.from_json(path.read_text())


@dataclass(frozen=True)
class DrafterOrigin(_FileRecord):
    """Where the starting drafter (start_drafter.py) came from, kept beside it: the directory the
    config named, its layout, what it reads, and the sha256 of its content (the training job
    resumes its checkpoints only for the same content)."""

    FILE_NAME: ClassVar[str] = "origin.json"
    source: str
    layout: str
    summary: str
    sha256: str


@dataclass(frozen=True)
class AcceptanceGap(_Record):
    """``eval/gap.json``: served acceptance against what validation predicts, held-out, greedy,
    at the headline draft length and concurrency, per position with the noise of each side,
    and the diagnosis (acceptance_gap.py). ``cause``: the failing check's name, "unexplained"
    for a gap beyond noise no check explains, None when there is nothing to explain."""

    expected: list[float]
    served: list[float]
    served_standard_error: list[float]
    validation_standard_error: list[float]
    validation_positions: int | None
    expected_conditional: list[float]
    served_conditional: list[float]
    beyond_noise: list[bool]
    gap_starts_at: str | None
    cause: str | None
    diagnosis: str | None
    summary: str
    checks: list[dict[str, Any]]
    other_sets: dict[str, Any]

    @classmethod
    def read(cls, path: Path) -> AcceptanceGap:
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


def merged(tallies) -> Tally:
    total = Tally()
    for tally in tallies:
        total.requests += tally.requests
        total.completion_tokens += tally.completion_tokens
        total.request_seconds += tally.request_seconds
        total.draft_tokens += tally.draft_tokens
        total.histogram = summed(total.histogram, tally.histogram)
        total.speed_sum += tally.speed_sum
        total.speed_squares += tally.speed_squares
    return total


def relative_spread(tally: Tally) -> float:
    """The spread of a speed measured on these requests, as a share of it: two standard errors
    of the mean per-request speed over that mean (about a 95% interval).

    Why per request: a phase is one wall-clock measurement, so its throughput has no spread
    of its own, and repeating every phase would double the evaluation. The requests' own
    speeds vary with the prompt, the batch they shared and the machine's other work; their
    mean is known to within this share, and a throughput built from the same requests is
    taken to be known as well as that mean."""
    n = tally.requests
    if n < 2 or tally.speed_sum <= 0:
        return 0.0
    mean = tally.speed_sum / n
    variance = max(tally.speed_squares / n - mean**2, 0.0) * n / (n - 1)
    return 2 * math.sqrt(variance / n) / mean


def acceptance_length(tally: Tally) -> float:
    steps = sum(tally.histogram)
    return 1.0 + accepted_tokens(tally) / steps if steps else 1.0


def accepted_tokens(tally: Tally) -> int:
    """Draft tokens accepted over all verify steps: histogram[j] steps accepted j each."""
    return sum(j * n for j, n in enumerate(tally.histogram))


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
    # The starting drafter (training.from_pretrained) before the run's data: an EAGLE-3 drafter
    # like the trained one, told apart by this mark.
    start: bool = False

    @property
    def speculative_method(self) -> str | None:
        return self.method or (DEFAULT_KIND if self.drafter else None)

    @property
    def name(self) -> str | None:
        """What the report calls it: the starting drafter, the kind of drafter, or the method."""
        return START_METHOD if self.start else self.kind or self.speculative_method

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
        if self.start:
            values["start"] = True
        return json.dumps(values, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Measurement:
        values = json.loads(text)
        return cls(**(values | {"phases": [Phase.from_dict(phase) for phase in values["phases"]]}))

    @classmethod
    def read(cls, path: Path) -> Measurement:
        return cls.from_json(path.read_text())


# --- eval/acceptance.json ------------------------------------------------------------------

WHOLE_SET = "*"  # the category of a result row that covers its whole set
RERUN_SUMMARY = "rerun the evaluation's summary (snakemake --forcerun evaluate: it reads the measurements again)"


class RecordError(DraftsmithError):
    pass


def _checked(cls: type, values: Any, where: str) -> dict[str, Any]:
    """``values`` as the keyword arguments of the dataclass ``cls``, or which key is off."""
    if not isinstance(values, dict):
        raise RecordError(f"{where} is not an object")
    known = {f.name: f for f in dataclasses.fields(cls)}
    missing = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING and n not in values]
    if missing:
        raise RecordError(f"{where} has no {', '.join(map(repr, missing))}")
    if unknown := sorted(set(values) - set(known)):
        raise RecordError(f"{where} has unknown keys {', '.join(map(repr, unknown))}")
    return values


@dataclass(frozen=True, kw_only=True)
class ResultRow:
    """One job's measurement of one set (``SetResult``) or one category of a set
    (``CategoryResult``), at one concurrency and sampling."""

    method: str  # the kind of drafter, or the free method (Measurement.name)
    num_speculative_tokens: int
    concurrency: int
    temperature: float
    set: str
    category: str  # WHOLE_SET for the whole set
    requests: int
    completion_tokens: int
    acceptance_length: float
    acceptance_per_position: list[float]
    tokens_per_step: float
    # The noise of each position's rate: its binomial standard error over the verify steps.
    acceptance_per_position_standard_error: list[float] = field(default_factory=list)
    # What the drafter's validation predicts (greedy rows of a trained drafter only): at
    # position i the share of validation positions whose first i+1 draft tokens were all
    # right (speculators' full_acc_i), and 1 + their sum for greedy chains of this length.
    expected_acceptance_per_position: list[float] | None = None
    expected_acceptance_length: float | None = None


@dataclass(frozen=True, kw_only=True)
class SetResult(ResultRow):
    """A whole set: its throughput (tokens over the phase's wall time) against the target alone's."""

    tokens_per_s_with_drafter: float
    tokens_per_s_with_drafter_spread: float
    tokens_per_s_without_drafter: float
    tokens_per_s_without_drafter_spread: float
    speedup: float | None
    with_drafter_seconds: float
    without_drafter_seconds: float


@dataclass(frozen=True, kw_only=True)
class CategoryResult(ResultRow):
    """A category, which shares its set's wall time: its speed per request."""

    request_tokens_per_s_with_drafter: float
    request_tokens_per_s_with_drafter_spread: float
    request_tokens_per_s_without_drafter: float
    request_tokens_per_s_without_drafter_spread: float
    speedup: float | None


def result_row(values: Any, where: str) -> SetResult | CategoryResult:
    kind = SetResult if isinstance(values, dict) and values.get("category") == WHOLE_SET else CategoryResult
    return kind(**_checked(kind, values, where))


@dataclass(frozen=True, kw_only=True)
class ServingOption:
    """One way to serve at one concurrency and sampling, all sets together."""

    tokens_per_s: float
    spread: float  # ± tokens per second
    acceptance_length: float
    tokens_per_step: float
    speedup: float | None  # over the target alone


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """At one concurrency and sampling: the drafter's draft length, and what to serve."""

    temperature: float
    concurrency: int
    num_speculative_tokens: int  # the drafter's best
    chosen_by: str  # "throughput", or "tokens per step" among those within noise
    within_noise: list[int]
    tokens_per_s_with_drafter: float
    tokens_per_s_with_drafter_spread: float
    tokens_per_s_without_drafter: float
    # Files from before throughputs had a spread read with none.
    tokens_per_s_without_drafter_spread: float = 0.0
    speedup: float | None
    # Per draft length (JSON keys: strings)
    tokens_per_s_by_draft_length: dict[str, float]
    spread_by_draft_length: dict[str, float] = field(default_factory=dict)
    acceptance_length_by_draft_length: dict[str, float]
    tokens_per_step_by_draft_length: dict[str, float]
    drafter_speculative_config: dict[str, Any]
    options: dict[str, ServingOption]  # "target alone", "drafter k=3", "ngram k=2", ...
    serve: str  # the name of the option to serve
    serve_chosen_by: str
    serve_within_noise: list[str]
    serve_speedup: float | None
    speculative_config: dict[str, Any] | None  # vLLM's, for what to serve; None: the target alone

    @classmethod
    def from_dict(cls, values: Any, where: str) -> Recommendation:
        values = _checked(cls, values, where)
        options = {
            name: ServingOption(**_checked(ServingOption, option, f"{where}'s option {name!r}"))
            for name, option in values["options"].items()
        }
        return cls(**values | {"options": options})


@dataclass(frozen=True, kw_only=True)
class DefaultCounts:
    """What one side (with the drafter or the target alone) counted at the default point."""

    requests: int
    completion_tokens: int
    seconds: float
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    tokens_per_step: float


@dataclass(frozen=True, kw_only=True)
class EvaluationSummary:
    """``eval/acceptance.json``. At its top level the numbers read first: the held-out set at
    the default (first) draft length and concurrency, greedy; beside them every ``results``
    row and the ``recommendation`` at each concurrency and sampling."""

    acceptance_length: float
    max_acceptance_length: int
    acceptance_per_position: list[float]
    tokens_per_s_with_drafter: float
    tokens_per_s_with_drafter_spread: float
    tokens_per_s_without_drafter: float
    tokens_per_s_without_drafter_spread: float
    speedup: float | None
    num_speculative_tokens: int
    concurrency: int
    with_drafter: DefaultCounts
    without_drafter: DefaultCounts
    # Written only with evaluation.compare_untrained
    untrained_acceptance_length: float | None = None
    untrained_acceptance_per_position: list[float] | None = None
    # Written only with training.from_pretrained: the starting drafter, before the run's data
    start_acceptance_length: float | None = None
    start_acceptance_per_position: list[float] | None = None
    # What the drafter's validation predicts at the top level's point, and the noise of both
    # sides: served rates' standard errors, and the validation split's trainable positions.
    expected_acceptance_length: float | None = None
    expected_acceptance_per_position: list[float] | None = None
    acceptance_per_position_standard_error: list[float] | None = None
    validation_positions: int | None = None
    mla_disabled: bool
    mla_disabled_because: str | None = None  # written only when MLA was disabled
    results: list[SetResult | CategoryResult]
    recommendation: list[Recommendation]

    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "untrained_acceptance_length",
        "untrained_acceptance_per_position",
        "start_acceptance_length",
        "start_acceptance_per_position",
        "expected_acceptance_length",
        "expected_acceptance_per_position",
        "acceptance_per_position_standard_error",
        "validation_positions",
        "mla_disabled_because",
    )

    @property
    def default_recommendation(self) -> Recommendation:
        """At the default concurrency, greedy: what drafter_speculative_config.json holds."""
        return next(r for r in self.recommendation if r.temperature == 0.0 and r.concurrency == self.concurrency)

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        return {key: value for key, value in values.items() if not (key in self.OPTIONAL and value is None)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "the evaluation summary") -> EvaluationSummary:
        values = _checked(cls, json.loads(text), where)
        return cls(
            **values
            | {
                "with_drafter": DefaultCounts(**_checked(DefaultCounts, values["with_drafter"], "with_drafter")),
                "without_drafter": DefaultCounts(
                    **_checked(DefaultCounts, values["without_drafter"], "without_drafter")
                ),
                "results": [result_row(row, f"results[{i}]") for i, row in enumerate(values["results"])],
                "recommendation": [
                    Recommendation.from_dict(row, f"recommendation[{i}]")
                    for i, row in enumerate(values["recommendation"])
                ],
            }
        )

    def write(self, path: Path) -> None:
        atomic_write_text(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> EvaluationSummary:
        """The summary at ``path``, or one line naming the file, what is off and the fix."""
        try:
            return cls.from_json(path.read_text(), "it")
        except (RecordError, json.JSONDecodeError) as error:
            raise RecordError(
                f"{path} is no evaluation summary this version reads ({error}): {RERUN_SUMMARY}"
            ) from None


# --- the evaluation's prompts (evaluation_sets.py -> evaluate.py, evaluation_summary.py) ----

HELDOUT = "heldout"  # the set of held-out questions, beside the named evaluation.sets
NO_CATEGORY = "all"  # a set's results when it names no category field


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """The prompts file of the evaluation sets (evaluation_sets.py writes it, one JSON per line)."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# --- generation's records (generate.py -> dataset.py, the report, the plan, the diagnosis) --

LAST_TURN = "last turn"
CONTEXT_FULL = "context full"  # the next prompt would leave no room for max_tokens


@dataclass
class GenerationRecord:
    """One conversation as the target answered it: a line of a shard's completions, and of
    its staging (with ``answers``, the context of the next turn). The row is the last turn's
    prompt and answer; ``loss_mask`` marks every answer the row holds verbatim. Records from
    before multi-turn conversations hold one turn and no turn fields."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]
    finish_reason: str | None  # the last turn's
    completion_tokens: int  # generated over every turn (what decoding cost)
    prompt_tokens: int  # the row's untrained tokens
    turns: int = 1
    turn_completion_tokens: list[int] | None = None
    turn_finish_reasons: list[str | None] | None = None
    answers: list[str] = field(default_factory=list)  # staged only: not published
    ended: str | None = LAST_TURN  # why no turn is left (None: the next one is to be asked)
    captured: bool | None = None  # one pass, published: whether its states are staged

    @classmethod
    def from_json(cls, line: str) -> GenerationRecord:
        return cls(**json.loads(line))

    def to_json(self, published: bool = False) -> str:
        data = dataclasses.asdict(self)
        if published:
            del data["answers"]
        if self.captured is None:
            del data["captured"]
        return json.dumps(data)

    @property
    def finished(self) -> bool:
        return self.ended is not None

    @property
    def turn_lengths(self) -> list[int]:
        """Tokens generated per turn."""
        return self.turn_completion_tokens if self.turn_completion_tokens is not None else [self.completion_tokens]

    @property
    def finish_reasons(self) -> list[str | None]:
        """Why each turn's answer ended ("length": cut at max_tokens)."""
        return self.turn_finish_reasons if self.turn_finish_reasons is not None else [self.finish_reason]


def read_generation_records(path: Path) -> Iterator[GenerationRecord]:
    """A completions file's records, in file order."""
    with path.open(encoding="utf-8") as handle:
        yield from (GenerationRecord.from_json(line) for line in handle if line.strip())
