"""Where every result lives: the one place that spells a path or a file name under results_dir.

The rule files (through ``common.smk``) and the stages both import this module, so the
layout the DAG declares and the layout the stages read (the plan, the training view,
the gate) cannot drift apart. Shard arguments may be a number or Snakemake's wildcard
text ``"{shard}"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HIDDEN_STATE_GLOB = "hs_*.safetensors"
SHARD_MANIFEST = "manifest.json"
# Inside a stage's directory, wherever that directory is (published, staged, a test's).
SHARD_GLOB = "shard_*"
GENERATION_RECORDS = "records.jsonl"  # a generation shard's staged answers
SUMMARY = "summary.json"  # a stage's own account of its run (questions, generation)
ROW_IDS = "row_ids.json"  # the dataset's row -> question id (prepare-data drops the ids)
CAPTURED_ROWS = "captured_rows.json"  # one pass: how many leading dataset rows were captured
CAPTURES = "captures"  # one pass: inside a generation shard's staging, the answers' states
TOKEN_FREQUENCIES = "token_freq.pt"  # the dataset's token counts: the draft vocabulary
TRAINING_METRICS = "training_metrics.json"  # published with the drafter
DRAFTER_CONFIG, DRAFTER_WEIGHTS = "config.json", "model.safetensors"  # what vLLM loads; no optimizer state


def shard_file(directory: Path | str, shard: int | str) -> Path:
    """A question or completion shard: ``shard_<n>.jsonl``."""
    return Path(directory) / f"shard_{shard}.jsonl"


def hidden_state_file(directory: Path | str, row: int) -> Path:
    """The file of dataset row ``row``: the name vLLM's connector path is staged under and
    the name `speculators train` reads (its FileTransfer looks up ``hs_<row>``)."""
    return Path(directory) / f"hs_{row}.safetensors"


def heldout_file(directory: Path | str) -> Path:
    return Path(directory) / "heldout.jsonl"


def hidden_state_row(path: Path) -> int:
    return int(path.stem.removeprefix("hs_"))


@dataclass(frozen=True)
class Layout:
    """The results directory of one config (``results_dir``); nothing outside it is written."""

    results: Path

    def __init__(self, results: Path | str):
        object.__setattr__(self, "results", Path(results))

    # Work in progress, outside every declared output (Snakemake deletes those on rerun).
    @property
    def staging(self) -> Path:
        return self.results / ".staging"

    def staging_for(self, stage: str, shard: int | str | None = None) -> Path:
        base = self.staging / stage
        return base if shard is None else base / f"shard_{shard}"

    @property
    def run_config(self) -> Path:
        """The validated config of the latest start, read by every job (see settings.py)."""
        return self.staging / "config.json"

    @property
    def preflight_record(self) -> Path:
        return self.staging / "preflight.json"

    @property
    def logs(self) -> Path:
        return self.results / "logs"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def benchmark(self, name: str) -> Path:
        """Snakemake's record of a heavy job: wall and CPU seconds, peak memory."""
        return self.results / "benchmarks" / f"{name}.tsv"

    # questions
    @property
    def questions(self) -> Path:
        return self.results / "questions"

    def question_shard(self, shard: int | str) -> Path:
        return shard_file(self.questions, shard)

    @property
    def heldout(self) -> Path:
        return heldout_file(self.questions)

    @property
    def questions_summary(self) -> Path:
        return self.questions / SUMMARY

    # generation
    @property
    def completions(self) -> Path:
        return self.results / "completions"

    def completion_shard(self, shard: int | str) -> Path:
        return shard_file(self.completions, shard)

    def completion_shards(self) -> list[Path]:
        return sorted(self.completions.glob(f"{SHARD_GLOB}.jsonl"))

    def staged_answer_files(self) -> list[Path]:
        return sorted(self.staging_for("completions").glob(f"{SHARD_GLOB}/{GENERATION_RECORDS}"))

    def captured_state_files(self) -> list[Path]:
        """One pass: the answers' states the generation shards staged."""
        return sorted(self.staging_for("completions").glob(f"{SHARD_GLOB}/{CAPTURES}/*.safetensors"))

    def extracted_shards(self) -> list[Path]:
        return sorted(p for p in self.hidden_states.glob(SHARD_GLOB) if p.is_dir())

    def hidden_state_files(self, staged: bool = False) -> list[Path]:
        """Every hidden-state file of the published (or the staged) extraction shards."""
        base = self.staging_for("hidden_states") if staged else self.hidden_states
        return sorted(base.glob(f"{SHARD_GLOB}/{HIDDEN_STATE_GLOB}"))

    # dataset, hidden states, training
    @property
    def dataset(self) -> Path:
        return self.results / "dataset"

    @property
    def hidden_states(self) -> Path:
        return self.results / "hidden_states"

    def hidden_state_shard(self, shard: int | str) -> Path:
        return self.hidden_states / f"shard_{shard}"

    @property
    def training_view(self) -> Path:
        return self.hidden_states / "all"

    @property
    def drafter(self) -> Path:
        return self.results / "drafter"

    @property
    def training_metrics(self) -> Path:
        return self.drafter / TRAINING_METRICS

    def kind_drafter(self, kind: str) -> Path:
        """A drafter of another kind than EAGLE-3 (training.kinds), trained from the same data."""
        return self.results / f"drafter_{kind}"

    @property
    def untrained_drafter(self) -> Path:
        return self.results / "untrained_drafter"

    @property
    def start_drafter(self) -> Path:
        """The drafter training.from_pretrained names, copied or converted (start_drafter.py)."""
        return self.results / "start_drafter"

    # evaluation (it owns the serving config: num_speculative_tokens is its setting)
    @property
    def speculative_config(self) -> Path:
        return self.results / "drafter_speculative_config.json"

    @property
    def evaluation(self) -> Path:
        return self.results / "eval"

    @property
    def evaluation_prompts(self) -> Path:
        return self.evaluation / "prompts.jsonl"

    @property
    def evaluation_sets_summary(self) -> Path:
        return self.evaluation / "sets.json"

    @property
    def baseline_measurement(self) -> Path:
        return self.evaluation / "baseline.json"

    def drafter_measurement(self, k: int | str) -> Path:
        return self.evaluation / f"drafter_k{k}.json"

    def untrained_measurement(self, k: int | str) -> Path:
        return self.evaluation / f"untrained_k{k}.json"

    def start_measurement(self, k: int | str) -> Path:
        return self.evaluation / f"start_k{k}.json"

    def free_method_measurement(self, method: str, k: int | str) -> Path:
        return self.evaluation / f"{method}_k{k}.json"

    def kind_measurement(self, kind: str, k: int | str) -> Path:
        return self.evaluation / f"{kind}_k{k}.json"

    @property
    def acceptance(self) -> Path:
        return self.evaluation / "acceptance.json"

    @property
    def acceptance_gap(self) -> Path:
        """Served acceptance against validation's prediction, and the diagnosis."""
        return self.evaluation / "gap.json"

    @property
    def acceptance_plot(self) -> Path:
        """Acceptance per prompt set (and category) and draft position."""
        return self.evaluation / "acceptance.png"

    @property
    def speedup_plot(self) -> Path:
        return self.evaluation / "speedup.png"

    @property
    def evaluation_tables(self) -> Path:
        """The recommendation and per-set tables, as HTML for the report."""
        return self.evaluation / "tables.html"

    # the plan and the report
    @property
    def plan_json(self) -> Path:
        return self.results / "plan.json"

    @property
    def plan_table(self) -> Path:
        return self.results / "plan.txt"

    @property
    def completion_lengths_plot(self) -> Path:
        return self.results / "report" / "completion_lengths.png"

    @property
    def training_curves_plot(self) -> Path:
        return self.results / "report" / "training_curves.png"

    @property
    def run_metadata(self) -> Path:
        return self.results / "report" / "run_metadata.txt"


@dataclass(frozen=True)
class TrainPaths:
    """One training job's inputs and outputs (its rule's paths), and its own work in
    ``staging``: checkpoints, speculators' dataset view, metrics, the capture directory."""

    dataset: Path
    hidden_states: Path
    staging: Path
    output: Path

    @property
    def checkpoints(self) -> Path:
        return self.staging / "checkpoints"

    @property
    def dataset_view(self) -> Path:
        """What speculators reads as its --data-path: links to the published dataset's
        files, because it writes its vocabulary mappings (d2t-N.npy, t2d-N.npy) into that
        directory, and the dataset stage's output is not ours to change."""
        return self.staging / "dataset"

    @property
    def metrics(self) -> Path:
        return self.staging / "metrics.jsonl"

    @property
    def args_record(self) -> Path:
        return self.staging / "train_args.json"

    @property
    def capture(self) -> Path:
        """Where the capture server writes the rows it is asked for (speculators deletes them)."""
        return self.staging / "capture"
