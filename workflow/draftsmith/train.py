"""Training stage: `speculators train` on the extracted hidden states, published for vLLM.

    python -m draftsmith.train --settings CONFIG --dataset DIR --hidden-states DIR \
        --staging DIR --output DIR [--granted-gpus N] [--untrained]

Everything a user can get wrong is checked before any work: the draft vocabulary
against the target's, the layers against the target, a hidden-state file for every
stored dataset row. On CPU the trainer runs through ``draftsmith.speculators_cpu``; on
CUDA under torchrun with one process per GPU of the slot.

Under a ``hidden_states.disk_budget`` the rows past the stored ones are captured while
training: this job starts the extraction server (same layers, connector and numerics, so
a captured row equals a stored one) as a capture server in its own slot, and speculators
asks it for each missing row when the trainer reaches it (``--on-missing generate``),
loads the file and deletes it. Captured files live in ``STAGING/capture``, emptied at
every start, so crashes never leave them behind.

The stage's other concerns have modules of their own: when checkpoints resume or start
afresh (training_checkpoints.py), the trainer process and its stall watch
(trainer_process.py), and the published drafter with its metrics (drafter_publish.py). The
best epoch (lowest validation loss, else the newest) is published without optimizer state to
``--output`` in one rename. The evaluation stage writes the ``--speculative-config`` JSON
(``num_speculative_tokens`` is its setting).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from datasets import load_from_disk
from safetensors import safe_open

from draftsmith.cli import read_settings, stage_parser
from draftsmith.disk_budget import RowSplit, row_split
from draftsmith.drafter_files import D2T, T2D, compatibility_problems, read_drafter
from draftsmith.drafter_kinds import DEFAULT_KIND, KINDS
from draftsmith.drafter_publish import capture_requests, publish
from draftsmith.errors import TrainError
from draftsmith.layers import LayerPlan, resolve_layers
from draftsmith.layout import (
    TOKEN_FREQUENCIES,
    TrainPaths,
    hidden_state_file,
)
from draftsmith.progress import log
from draftsmith.records import DrafterOrigin, RowIds
from draftsmith.run_config import RunConfig
from draftsmith.server import Endpoint, ServerSpec, managed_server
from draftsmith.settings import item_settings
from draftsmith.slot import GpuSlotError, check_gpu_slot
from draftsmith.target import TargetShape, draft_vocab_problem, read_target_shape
from draftsmith.trainer_process import run_trainer
from draftsmith.training_checkpoints import chosen_epoch, drop_unfinished_epoch, reset_if_changed

# `speculators train` flags this stage passes (speculators_args, CPU_TRAINER_FLAGS, kind_args),
# on every branch: tests/test_preflight.py builds each and checks it against this list.
TRAIN_FLAGS = [
    "--verifier-name-or-path",
    "--target-layer-ids",
    "--token-freq-path",
    "--draft-vocab-size",
    "--epochs",
    "--lr",
    "--total-seq-len",
    "--seed",
    "--save-path",
    "--data-path",
    "--hidden-states-path",
    "--on-missing",
    "--num-workers",
    "--draft-attn-impl",
    "--loss-implementation",
    "--num-layers",
    "--hidden-states-dtype",
    "--vllm-endpoint",
    "--hidden-states-backend",
    "--trust-remote-code",
    "--speculator-type",
    "--from-pretrained",
    "--d2t-path",
    "--t2d-path",
]
# On a CPU only: no dataloader workers, attention without flex-attention's compiler, and
# fp32 compute. speculators autocasts to bf16 by default, and on a CPU without AVX512-BF16
# or AMX (an AVX2 EPYC here) bf16 matmuls fall back to a naive kernel: a demo step took
# 19.3 s of CPU in bf16 and 4.1 s in fp32 (torch.profiler, 3 steps).
CPU_TRAINER_FLAGS = ["--num-workers", "0", "--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32"]
SHOW_MISSING = 5
# Stands for the capture server's URL in the arguments (its port is new at every start):
# the recorded arguments stay equal across restarts, so the checkpoints resume.
CAPTURE_ENDPOINT = "<capture-server>"
# speculators' dataset connects with this key built in; the server listens on loopback only.
CAPTURE_API_KEY = "EMPTY"


# ---------------------------------------------------------------------------------------------
# Checks before any work
# ---------------------------------------------------------------------------------------------


def row_label(dataset: Path, row: int) -> str:
    row_ids = RowIds.read(dataset)
    return f"row {row} (question {row_ids.ids[row]})" if row_ids else f"row {row}"


def check_dataset(dataset: Path) -> int:
    """Number of rows; the token frequencies the draft vocabulary is built from must be there."""
    if not (dataset / TOKEN_FREQUENCIES).is_file():
        raise TrainError(f"{dataset / TOKEN_FREQUENCIES} is missing; rerun the dataset stage")
    rows = load_from_disk(str(dataset)).num_rows
    if rows == 0:
        raise TrainError(f"the dataset {dataset} has no rows; check the dataset stage's log")
    return rows


# speculators' default share of the rows it validates on: its last rows.
SPECULATORS_VALIDATION_FRACTION = 0.1


def validation_positions(dataset: Path, validation_fraction: float) -> int:
    """Trainable positions of speculators' validation split (its last rows, after the shift
    that pairs each token with the state before it): how well full_acc_i is known."""
    ratio = 1 - validation_fraction
    rows = load_from_disk(str(dataset)).with_format(None)
    masks = rows.select(range(int(rows.num_rows * ratio), rows.num_rows))["loss_mask"]
    return sum(sum(mask[1:]) for mask in masks)


def check_hidden_states(paths: TrainPaths, split: RowSplit, stored_layers: int, hidden_size: int) -> None:
    """Every stored row has its file (speculators would stop at the first gap, mid-epoch),
    no row past them has one (it would be trained on instead of captured), and the first
    file has the stored layers and width this target and config imply."""
    missing = [row for row in range(split.stored) if not hidden_state_file(paths.hidden_states, row).is_file()]
    if missing:
        named = ", ".join(row_label(paths.dataset, row) for row in missing[:SHOW_MISSING])
        more = f" and {len(missing) - SHOW_MISSING} more" if len(missing) > SHOW_MISSING else ""
        raise TrainError(
            f"no hidden states for {len(missing)} of {split.stored} stored dataset rows in "
            f"{paths.hidden_states}: {named}{more}; rerun the extraction stage"
        )
    if hidden_state_file(paths.hidden_states, split.stored).exists():
        raise TrainError(
            f"{paths.hidden_states} holds more rows than hidden_states.disk_budget stores ({split.stored}); "
            "rerun the extraction stage"
        )
    if split.stored == 0:
        return
    first = hidden_state_file(paths.hidden_states, 0)
    with safe_open(first, framework="pt") as handle:
        shape = handle.get_slice("hidden_states").get_shape()
    if len(shape) != 3 or shape[1:] != [stored_layers, hidden_size]:
        raise TrainError(
            f"{first} holds hidden states of shape {shape}, expected [tokens, {stored_layers}, "
            f"{hidden_size}] for layers of this config; rerun the extraction stage"
        )


@dataclasses.dataclass(frozen=True)
class TrainingInputs:
    """What the checks found, read once for the whole job: the layers, which rows are stored
    and which captured, and the target's shape (the capture server's files take it)."""

    plan: LayerPlan
    split: RowSplit
    target: TargetShape


def preflight(settings: RunConfig, paths: TrainPaths) -> TrainingInputs:
    target = read_target_shape(settings.target.model)
    if problem := draft_vocab_problem(settings.training.draft_vocab_size, target.vocab_size):
        raise TrainError(problem)
    plan = resolve_layers(list(settings.layers), target.num_hidden_layers)
    check_dataset(paths.dataset)
    hidden_states = settings.hidden_states
    row = settings.stored_row(target)
    split = row_split(paths.dataset, hidden_states.limited_budget, row)
    check_hidden_states(paths, split, len(plan.vllm_ids), target.hidden_size)
    log(f"checked: {split.describe()}, aux vLLM ids {plan.aux_vllm_ids}")
    return TrainingInputs(plan, split, target)


def check_start(settings: RunConfig, inputs: TrainingInputs, start: Path) -> None:
    """The prepared starting drafter against this run (the preflight checked the one the
    config names; a conversion could still have changed it)."""
    facts = read_drafter(start)
    problems = compatibility_problems(
        facts,
        hidden_size=inputs.target.hidden_size,
        vocab_size=inputs.target.vocab_size,
        plan=inputs.plan,
        draft_vocab_size=settings.training.draft_vocab_size,
        target_name=settings.target.model,
    )
    if problems:
        raise TrainError(problems[0])
    log(f"fine-tuning the {facts.describe()}")


def training_processes(settings: RunConfig, granted: int | None) -> int:
    """One trainer process per GPU of the slot; 1 on CPU (the count settings.py tracks)."""
    slot = settings.trainer_processes
    if not settings.on_cuda:
        return slot
    check_gpu_slot(settings, granted)
    if granted is not None and granted < slot:
        raise GpuSlotError(
            f"training runs on gpu_slot={slot} GPUs but this job was granted {granted}; run "
            f"snakemake with --resources gpu={slot} (or lower gpu_slot)"
        )
    return slot


# ---------------------------------------------------------------------------------------------
# The speculators command
# ---------------------------------------------------------------------------------------------


def speculators_args(
    settings: RunConfig,
    plan: LayerPlan,
    paths: TrainPaths,
    captures: bool = False,
    kind: str = DEFAULT_KIND,
    target_vocab_size: int | None = None,
    start: Path | None = None,
) -> list[str]:
    """Arguments of `speculators train` (flags measured on a CPU and an H200: docs/cpu.md);
    ``captures``: rows without a file are asked of the capture server; ``start``: the drafter
    to fine-tune (start_drafter.py), with its own vocabulary map."""
    training = settings.training
    argv = [
        "--verifier-name-or-path",
        settings.target.model,
        # The auxiliary ids only: the last stored layer is the training target.
        "--target-layer-ids",
        *map(str, plan.aux_vllm_ids),
        "--token-freq-path",
        str(paths.dataset / TOKEN_FREQUENCIES),
        "--draft-vocab-size",
        str(training.draft_vocab_size),
        # A starting drafter's shape is its own: speculators refuses --num-layers beside it.
        *(["--num-layers", str(training.num_layers)] if start is None else []),
        "--epochs",
        str(training.epochs),
        "--lr",
        str(training.fine_tune_lr if start is not None and training.fine_tune_lr is not None else training.lr),
        "--total-seq-len",
        str(training.total_seq_len),
        "--seed",
        str(training.seed),
        "--save-path",
        str(paths.checkpoints),
        "--data-path",
        str(paths.dataset_view),
        "--hidden-states-path",
        str(paths.hidden_states),
        *(["--on-missing", "generate", "--vllm-endpoint", CAPTURE_ENDPOINT] if captures else ["--on-missing", "raise"]),
        # fp8 rows (stored and captured) are dequantized to bf16 as they are loaded.
        *(["--hidden-states-backend", "fp8"] if settings.hidden_states.fp8 else []),
        "--loss-implementation",
        "eager",  # the fused Triton loss crashed under torch.compile
    ]
    if settings.device == "cpu":
        argv += CPU_TRAINER_FLAGS
    if settings.target.trust_remote_code:
        argv.append("--trust-remote-code")
    if training.validation_fraction != SPECULATORS_VALIDATION_FRACTION:  # else the command of earlier runs
        argv += ["--train-data-ratio", str(1 - training.validation_fraction)]
    if start is not None:
        # Its output head's rows are indexed by its own map: one recomputed from this run's
        # token frequencies would point each learnt row at another token.
        argv += ["--from-pretrained", str(start), "--d2t-path", str(start / D2T), "--t2d-path", str(start / T2D)]
    if kind == DEFAULT_KIND:
        # EAGLE-3's command stays that of runs made before kinds existed, so their
        # checkpoints are continued, not reset.
        return argv + list(training.extra_args)
    return argv + kind_args(kind, target_vocab_size) + list(training.extra_args) + training.kind_args.get(kind, [])


def kind_args(kind: str, target_vocab_size: int | None) -> list[str]:
    """What another kind of drafter changes (a later flag wins in speculators' parser)."""
    argv = ["--speculator-type", kind]
    if KINDS[kind].full_vocabulary and target_vocab_size:
        argv += ["--draft-vocab-size", str(target_vocab_size)]
    return argv


def launcher(settings: RunConfig, processes: int) -> list[str]:
    entry = ["-m", "draftsmith.speculators_cpu", "train"]
    if not settings.on_cuda:
        return [sys.executable, *entry]
    # --standalone: a private rendezvous on a free port, so two jobs on a host never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), *entry]


def train_command(
    settings: RunConfig,
    plan: LayerPlan,
    paths: TrainPaths,
    processes: int,
    captures: bool,
    kind: str = DEFAULT_KIND,
    target_vocab_size: int | None = None,
    start: Path | None = None,
) -> list[str]:
    args = speculators_args(settings, plan, paths, captures, kind, target_vocab_size, start)
    return launcher(settings, processes) + args


def with_endpoint(command: list[str], endpoint: Endpoint | None) -> list[str]:
    return [endpoint.base_url if arg == CAPTURE_ENDPOINT and endpoint else arg for arg in command]


@contextlib.contextmanager
def capture_server(settings: RunConfig, paths: TrainPaths, inputs: TrainingInputs) -> Iterator[Endpoint | None]:
    """The extraction server, for the rows past the disk budget (None when all are stored).
    Its files are deleted by speculators as it loads them; what a crash left goes here."""
    split, plan = inputs.split, inputs.plan
    if split.captured == 0:
        yield None
        return
    from draftsmith.capture_server import extraction_server_args, sample_shape  # torch: only when capturing

    shape = sample_shape(settings, inputs.target)
    shutil.rmtree(paths.capture, ignore_errors=True)
    paths.capture.mkdir(parents=True)
    # Its numerics are the extraction server's; only its access log (a line per row) is off.
    extra = [*extraction_server_args(plan, paths.capture, shape), "--disable-uvicorn-access-log"]
    if settings.on_cuda:  # the trainer shares the GPUs: the server takes its share only
        extra += ["--gpu-memory-utilization", str(settings.hidden_states.capture_memory_fraction)]
    log(f"{split.describe()}: starting the capture server")
    try:
        with managed_server(ServerSpec.from_config(settings, extra_args=extra), api_key=CAPTURE_API_KEY) as endpoint:
            yield endpoint
    finally:
        shutil.rmtree(paths.capture, ignore_errors=True)


VOCABULARY_MAPPINGS = ("d2t-*.npy", "t2d-*.npy")


def link_dataset_view(paths: TrainPaths) -> None:
    """(Re)link the dataset's files into the view; mappings speculators wrote into the view
    before are dropped with it (they are derived from token_freq.pt in a second)."""
    shutil.rmtree(paths.dataset_view, ignore_errors=True)
    paths.dataset_view.mkdir(parents=True)
    skipped = {path for pattern in VOCABULARY_MAPPINGS for path in paths.dataset.glob(pattern)}
    for path in sorted(set(paths.dataset.iterdir()) - skipped):
        (paths.dataset_view / path.name).symlink_to(path.resolve())


def run(
    settings: RunConfig,
    paths: TrainPaths,
    granted: int | None = None,
    untrained: bool = False,
    kind: str = DEFAULT_KIND,
    start: Path | None = None,
) -> None:
    processes = training_processes(settings, granted)
    inputs = preflight(settings, paths)
    plan, split = inputs.plan, inputs.split
    captures = split.captured > 0 and not untrained  # a dry run reads no data
    vocab = inputs.target.vocab_size
    if start is not None:
        check_start(settings, inputs, start)
    command = train_command(settings, plan, paths, processes, captures, kind, vocab, start)
    paths.staging.mkdir(parents=True, exist_ok=True)
    link_dataset_view(paths)
    if untrained:
        # speculators' dry run: the same drafter, initialized and saved, never trained. The
        # evaluation serves it as the baseline that training must clearly beat.
        shutil.rmtree(paths.checkpoints, ignore_errors=True)
        run_trainer([*command, "--dry-run"], paths.metrics, settings.training.stall_timeout_s)
        publish(plan, paths, paths.checkpoints)
        return
    args = speculators_args(settings, plan, paths, captures, kind, vocab, start)
    software = item_settings(settings.source, "train")["software"]
    origin = DrafterOrigin.read(start) if start is not None else None
    if origin is not None:  # the same path holds whichever drafter the run starts from
        software = software | {"start_drafter": origin.sha256}
    reset_if_changed(paths, args, settings.training.epochs, software)
    drop_unfinished_epoch(paths)
    requests = 0
    if settings.device == "cuda":
        # A quiet log then is not a hang (minutes on an H100 even for a 135M target's drafter:
        # docs/gpu.md, "The fourth time").
        log("the first step and the first validation compile the drafter (torch.compile): minutes without output")
    with capture_server(settings, paths, inputs) as endpoint:
        run_trainer(with_endpoint(command, endpoint), paths.metrics, settings.training.stall_timeout_s)
        if endpoint is not None:
            requests = capture_requests(endpoint)
            log(f"the capture server answered {requests} requests for rows past the disk budget")
    started_from = origin.summary if origin is not None else None
    validated = validation_positions(paths.dataset, settings.training.validation_fraction)
    publish(plan, paths, chosen_epoch(paths.checkpoints), split, requests, kind, started_from, validated)


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(__doc__)
    parser.add_argument("--dataset", required=True, type=Path, help="prepared dataset directory")
    parser.add_argument("--hidden-states", required=True, type=Path, help="directory of hs_<row>.safetensors")
    parser.add_argument("--staging", required=True, type=Path, help="checkpoints and partial work")
    parser.add_argument("--output", required=True, type=Path, help="drafter directory to publish")
    parser.add_argument("--granted-gpus", type=int, default=None)
    parser.add_argument(
        "--untrained", action="store_true", help="publish the initialized, untrained drafter (an evaluation baseline)"
    )
    parser.add_argument(
        "--kind", choices=sorted(KINDS), default=DEFAULT_KIND, help="the kind of drafter (training.kinds)"
    )
    parser.add_argument(
        "--start-drafter", type=Path, default=None, help="fine-tune this drafter (the start_drafter stage's output)"
    )
    args = parser.parse_args(argv)
    # A SIGTERM (Snakemake, SLURM) unwinds through run_trainer's finally, which stops the trainer.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    paths = TrainPaths(args.dataset, args.hidden_states, args.staging, args.output)
    stage = "untrained_drafter" if args.untrained else "train" if args.kind == DEFAULT_KIND else "train_kind"
    run(read_settings(args.settings, stage), paths, args.granted_gpus, args.untrained, args.kind, args.start_drafter)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
