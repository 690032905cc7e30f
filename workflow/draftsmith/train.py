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

Checkpoints live in ``STAGING/checkpoints``, outside the declared outputs, so a crash
or a Snakemake rerun keeps them: speculators resumes by itself from the newest epoch
there. Raising ``training.epochs`` continues from the last epoch; any other change of
the arguments, the software or the data starts afresh (``STAGING/train_args.json``
remembers them). The data is identified by content (tokens, masks, the extraction
manifests), not by file times, so republished but unchanged inputs resume. The best
epoch (lowest validation loss, else the newest) is copied without optimizer state to
``--output`` in one rename, with ``training_metrics.json``. The evaluation stage writes
the ``--speculative-config`` JSON (``num_speculative_tokens`` is its setting).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from datasets import load_from_disk
from safetensors import safe_open

from draftsmith.atomic import atomic_write_text, publish_directory
from draftsmith.cli import SETTINGS_HELP, read_settings
from draftsmith.disk_budget import RowSplit, row_split
from draftsmith.errors import DraftsmithError
from draftsmith.guard import guarded, stop_process_group, uncapped_environment
from draftsmith.layers import LayerPlan, resolve_layers
from draftsmith.layout import (
    HIDDEN_STATE_GLOB,
    ROW_IDS,
    SHARD_MANIFEST,
    TOKEN_FREQUENCIES,
    TrainPaths,
    hidden_state_file,
)
from draftsmith.progress import log, stderr_file
from draftsmith.records import TrainingMetrics
from draftsmith.run_config import RunConfig
from draftsmith.server import Endpoint, ServerSpec, counter_totals, log_tail, managed_server, read_metrics
from draftsmith.settings import item_settings
from draftsmith.slot import GpuSlotError, check_gpu_slot
from draftsmith.speculators_cpu import METRICS_FILE_ENV
from draftsmith.target import draft_vocab_problem, read_target_shape

DRAFTER_FILES = ("config.json", "model.safetensors")  # what vLLM loads; no optimizer state
# On a CPU only: no dataloader workers, attention without flex-attention's compiler, and
# fp32 compute. speculators autocasts to bf16 by default, and on a CPU without AVX512-BF16
# or AMX (an AVX2 EPYC here) bf16 matmuls fall back to a naive kernel: a demo step took
# 19.3 s of CPU in bf16 and 4.1 s in fp32 (torch.profiler, 3 steps).
# `speculators train` flags this stage passes (speculators_args, CPU_TRAINER_FLAGS).
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
]
CPU_TRAINER_FLAGS = ["--num-workers", "0", "--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32"]
SHOW_MISSING = 5
# Stands for the capture server's URL in the arguments (its port is new at every start):
# the recorded arguments stay equal across restarts, so the checkpoints resume.
CAPTURE_ENDPOINT = "<capture-server>"
# speculators' dataset connects with this key built in; the server listens on loopback only.
CAPTURE_API_KEY = "EMPTY"


class TrainError(DraftsmithError):
    pass


# ---------------------------------------------------------------------------------------------
# Checks before any work
# ---------------------------------------------------------------------------------------------


def row_label(dataset: Path, row: int) -> str:
    row_ids = dataset / ROW_IDS
    if row_ids.is_file():
        return f"row {row} (question {json.loads(row_ids.read_text())[row]})"
    return f"row {row}"


def check_dataset(dataset: Path) -> int:
    """Number of rows; the token frequencies the draft vocabulary is built from must be there."""
    if not (dataset / TOKEN_FREQUENCIES).is_file():
        raise TrainError(f"{dataset / TOKEN_FREQUENCIES} is missing; rerun the dataset stage")
    rows = load_from_disk(str(dataset)).num_rows
    if rows == 0:
        raise TrainError(f"the dataset {dataset} has no rows; check the dataset stage's log")
    return rows


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


def preflight(settings: RunConfig, paths: TrainPaths) -> tuple[LayerPlan, RowSplit]:
    target = read_target_shape(settings.target.model)
    if problem := draft_vocab_problem(settings.training.draft_vocab_size, target.vocab_size):
        raise TrainError(problem)
    plan = resolve_layers(list(settings.layers), target.num_hidden_layers)
    check_dataset(paths.dataset)
    hidden_states = settings.hidden_states
    split = row_split(
        paths.dataset, hidden_states.limited_budget, len(plan.vllm_ids), target.hidden_size, hidden_states.fp8
    )
    check_hidden_states(paths, split, len(plan.vllm_ids), target.hidden_size)
    log(f"checked: {split.describe()}, aux vLLM ids {plan.aux_vllm_ids}")
    return plan, split


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


def speculators_args(settings: RunConfig, plan: LayerPlan, paths: TrainPaths, captures: bool = False) -> list[str]:
    """Arguments of `speculators train` (flags from DESIGN.md's CPU and H200 runs);
    ``captures``: rows without a file are asked of the capture server."""
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
        "--num-layers",
        str(training.num_layers),
        "--epochs",
        str(training.epochs),
        "--lr",
        str(training.lr),
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
    return argv + list(training.extra_args)


def launcher(settings: RunConfig, processes: int) -> list[str]:
    entry = ["-m", "draftsmith.speculators_cpu", "train"]
    if not settings.on_cuda:
        return [sys.executable, *entry]
    # --standalone: a private rendezvous on a free port, so two jobs on a host never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), *entry]


def train_command(settings: RunConfig, plan: LayerPlan, paths: TrainPaths, processes: int, captures: bool) -> list[str]:
    return launcher(settings, processes) + speculators_args(settings, plan, paths, captures)


def with_endpoint(command: list[str], endpoint: Endpoint | None) -> list[str]:
    return [endpoint.base_url if arg == CAPTURE_ENDPOINT and endpoint else arg for arg in command]


@contextlib.contextmanager
def capture_server(settings: RunConfig, paths: TrainPaths, split: RowSplit) -> Iterator[Endpoint | None]:
    """The extraction server, for the rows past the disk budget (None when all are stored).
    Its files are deleted by speculators as it loads them; what a crash left goes here."""
    if split.captured == 0:
        yield None
        return
    from draftsmith.extract import extraction_server_args, target_shape

    plan, shape = target_shape(settings)
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


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------


def without_epochs(args: list[str]) -> list[str]:
    index = args.index("--epochs")
    return args[:index] + args[index + 2 :]


def _column_digest(digest, column: pa.ChunkedArray) -> None:
    column = column.combine_chunks()
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        digest.update(pc.list_value_length(column).to_numpy(zero_copy_only=False).tobytes())
        digest.update(pc.list_flatten(column).to_numpy(zero_copy_only=False).tobytes())
    else:
        digest.update(json.dumps(column.to_pylist(), default=str).encode())


def inputs_fingerprint(paths: TrainPaths) -> str:
    """Identity of the training data by content, not by file times: the dataset's columns
    (tokens, loss masks) and row ids, and for the hidden states each row's file size and
    the manifests of the shards they come from (rows, layers, dtype and the settings the
    files were made under). A republished but unchanged input resumes the checkpoints;
    regenerated data does not. Hashing the hidden states themselves (terabytes) is out."""
    digest = hashlib.sha256()
    table = load_from_disk(str(paths.dataset)).data.table
    for name in sorted(table.column_names):
        digest.update(f"column {name}\n".encode())
        _column_digest(digest, table.column(name))
    row_ids = paths.dataset / ROW_IDS
    digest.update(row_ids.read_bytes() if row_ids.is_file() else b"no row ids")
    shards = set()
    for path in sorted(paths.hidden_states.glob(HIDDEN_STATE_GLOB)):
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
        shards.add(path.resolve().parent)
    for shard in sorted(shards):
        manifest = shard / SHARD_MANIFEST
        digest.update(manifest.read_bytes() if manifest.is_file() else f"{shard} unlisted".encode())
    return digest.hexdigest()


def reset_if_changed(paths: TrainPaths, args: list[str], epochs: int, software: dict[str, Any]) -> None:
    """Drop checkpoints trained with other arguments, software or data, or past the
    requested epochs; more epochs than before continue them."""
    recorded = [
        *without_epochs(args),
        "--software",
        json.dumps(software, sort_keys=True),
        "--inputs",
        inputs_fingerprint(paths),
    ]
    changed = paths.args_record.is_file() and json.loads(paths.args_record.read_text()) != recorded
    finished = epoch_dirs(paths.checkpoints)
    if changed or (finished and int(finished[-1].name) >= epochs):
        reason = "training arguments changed" if changed else f"more than {epochs} epochs trained"
        log(f"{reason} since the checkpoints in {paths.checkpoints}: starting afresh")
        shutil.rmtree(paths.checkpoints, ignore_errors=True)
        paths.metrics.unlink(missing_ok=True)
    atomic_write_text(paths.args_record, json.dumps(recorded) + "\n")


def epoch_dirs(checkpoints: Path) -> list[Path]:
    if not checkpoints.is_dir():
        return []
    # Skip speculators' links (checkpoint_best, epoch3_end) and "interrupted", which it ignores.
    found = [d for d in checkpoints.iterdir() if d.is_dir() and not d.is_symlink() and d.name.isdigit()]
    return sorted(found, key=lambda d: int(d.name))


def drop_unfinished_epoch(checkpoints: Path) -> None:
    """A crash while saving leaves an epoch without training_state.json (written last);
    speculators would try to resume from it, so it goes and that epoch is retrained."""
    epochs = epoch_dirs(checkpoints)
    if epochs and not (epochs[-1] / "training_state.json").is_file():
        log(f"removing unfinished checkpoint {epochs[-1]}")
        shutil.rmtree(epochs[-1])


# ---------------------------------------------------------------------------------------------
# Run and publish
# ---------------------------------------------------------------------------------------------


def wait_while_writing(process: subprocess.Popen[bytes], stall_timeout_s: float) -> int:
    """The trainer's exit code; a TrainError if its output stops for ``stall_timeout_s``.

    Seen on the H200: under torchrun a worker that ran out of GPU memory printed its
    traceback and then hung, holding the GPU, instead of exiting. The trainer writes to
    our stderr (the rule's log), so a log that stops growing is the sign. Where stderr
    is not a file (a terminal), there is nothing to watch and we just wait."""
    if not stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode):
        return process.wait()
    last_size, last_change = -1, time.monotonic()
    while True:
        try:
            return process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        size = os.fstat(sys.stderr.fileno()).st_size
        if size != last_size:
            last_size, last_change = size, time.monotonic()
        elif time.monotonic() - last_change > stall_timeout_s:
            raise TrainError(
                f"speculators train wrote nothing for {stall_timeout_s:.0f}s, so it was stopped; a "
                "crashed worker (e.g. out of GPU memory: see the traceback above) can hang instead "
                "of exiting. If it was only slow, raise training.stall_timeout_s"
            )


def run_trainer(command: list[str], metrics_file: Path, stall_timeout_s: float) -> None:
    # Rich wraps log lines at 80 columns when writing to a file; wide lines stay greppable.
    env = {"COLUMNS": "200", **uncapped_environment(), METRICS_FILE_ENV: str(metrics_file)}
    log("running: " + " ".join(command))
    sys.stderr.flush()
    # Under the guard, so torchrun's workers are stopped with it even after a SIGKILL.
    process = subprocess.Popen(guarded(command), stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        returncode = wait_while_writing(process, stall_timeout_s)
    finally:
        stop_process_group(process)
    if returncode != 0:
        log_path = stderr_file()
        tail = log_tail(log_path, 400) if log_path else ""
        if "OutOfMemoryError" in tail:
            raise TrainError(
                f"speculators train ran out of GPU memory (exit {returncode}); lower "
                "training.total_seq_len (tokens per step) and rerun"
            )
        if "No space left on device" in tail:
            # A capture server or a checkpoint save that found the disk full: the captured
            # files are deleted with this job, the finished epochs are kept.
            raise TrainError(
                f"the disk filled while training (exit {returncode}: captured rows or a checkpoint could not be "
                "written); free space or lower hidden_states.disk_budget, then rerun: training resumes"
            )
        raise TrainError(f"speculators train failed (exit {returncode}); see the log above")


def chosen_epoch(checkpoints: Path) -> Path:
    """The epoch with the lowest validation loss (speculators' checkpoint_best), else the newest."""
    best = checkpoints / "checkpoint_best"
    if best.is_dir():
        return best.resolve()
    epochs = epoch_dirs(checkpoints)
    if not epochs:
        raise TrainError(f"speculators train finished without a checkpoint in {checkpoints}")
    return epochs[-1]


def stage_drafter(epoch_dir: Path, plan: LayerPlan, drafter: Path) -> None:
    """Copy what vLLM loads and make sure the config names the aux layers we extracted."""
    drafter.mkdir(parents=True)
    for name in DRAFTER_FILES:
        shutil.copy2(epoch_dir / name, drafter / name)
    config_path = drafter / "config.json"
    config = json.loads(config_path.read_text())
    model_type = config.get("speculators_model_type")
    if model_type != "eagle3":
        raise TrainError(
            f"{epoch_dir}/config.json has speculators_model_type {model_type!r}, "
            "expected 'eagle3'; check training.extra_args"
        )
    # vLLM captures exactly these ids at serving time: they must be the ones trained on.
    found = config.get("eagle_aux_hidden_state_layer_ids")
    if found != plan.aux_vllm_ids:
        log(f"setting eagle_aux_hidden_state_layer_ids {found} -> {plan.aux_vllm_ids}")
        config["eagle_aux_hidden_state_layer_ids"] = plan.aux_vllm_ids
        atomic_write_text(config_path, json.dumps(config, indent=2) + "\n")


def read_metric_records(metrics_file: Path) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Train records by global step and validation records by epoch; a rerun's records
    (after a resume) replace the ones it repeats."""
    steps: dict[int, dict[str, Any]] = {}
    validations: dict[int, dict[str, Any]] = {}
    if metrics_file.is_file():
        for line in metrics_file.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if "train" in record:
                steps[record["global_step"]] = record
            elif "val" in record:
                validations[record["epoch"]] = record
    return steps, validations


def epoch_metrics(metrics_file: Path) -> list[dict[str, Any]]:
    """Per epoch: the mean of each training metric over its steps, and the validation
    metrics (speculators' ``*_epoch`` names without the suffix)."""
    steps, validations = read_metric_records(metrics_file)
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for record in steps.values():
        by_epoch.setdefault(record["epoch"], []).append(record["train"])
    result = []
    for epoch in sorted(set(by_epoch) | set(validations)):
        train = by_epoch.get(epoch, [])
        result.append(
            {
                "epoch": epoch,
                "steps": len(train),
                "train": {key: sum(step[key] for step in train) / len(train) for key in (train[0] if train else {})},
                "val": {
                    key.removesuffix("_epoch"): value
                    for key, value in validations.get(epoch, {}).get("val", {}).items()
                },
            }
        )
    return result


FINISHED_REQUESTS = "vllm:request_success_total"


def capture_requests(endpoint: Endpoint) -> int:
    """Rows the capture server answered, by its own counter (finished requests)."""
    return counter_totals(read_metrics(endpoint), [FINISHED_REQUESTS])[FINISHED_REQUESTS]


def publish(
    plan: LayerPlan, paths: TrainPaths, epoch_dir: Path, split: RowSplit | None = None, capture_requests: int = 0
) -> None:
    """``split``: where the rows came from (stored or captured); ``capture_requests``: the
    requests the capture server answered."""
    partial = paths.staging / "drafter.partial"
    shutil.rmtree(partial, ignore_errors=True)
    stage_drafter(epoch_dir, plan, partial)
    published = int(epoch_dir.name) if epoch_dir.name.isdigit() else None  # None: untrained
    metrics = TrainingMetrics(published, epoch_metrics(paths.metrics))
    if split is not None:
        metrics = dataclasses.replace(
            metrics, rows_stored=split.stored, rows_captured_per_epoch=split.captured, capture_requests=capture_requests
        )
    metrics.write(partial)
    publish_directory(partial, paths.output)
    log(f"published epoch {epoch_dir.name} to {paths.output}")


VOCABULARY_MAPPINGS = ("d2t-*.npy", "t2d-*.npy")


def link_dataset_view(paths: TrainPaths) -> None:
    """(Re)link the dataset's files into the view; mappings speculators wrote into the view
    before are dropped with it (they are derived from token_freq.pt in a second)."""
    shutil.rmtree(paths.dataset_view, ignore_errors=True)
    paths.dataset_view.mkdir(parents=True)
    skipped = {path for pattern in VOCABULARY_MAPPINGS for path in paths.dataset.glob(pattern)}
    for path in sorted(set(paths.dataset.iterdir()) - skipped):
        (paths.dataset_view / path.name).symlink_to(path.resolve())


def run(settings: RunConfig, paths: TrainPaths, granted: int | None = None, untrained: bool = False) -> None:
    processes = training_processes(settings, granted)
    plan, split = preflight(settings, paths)
    captures = split.captured > 0 and not untrained  # a dry run reads no data
    command = train_command(settings, plan, paths, processes, captures)
    paths.staging.mkdir(parents=True, exist_ok=True)
    link_dataset_view(paths)
    if untrained:
        # speculators' dry run: the same drafter, initialized and saved, never trained. The
        # evaluation serves it as the baseline that training must clearly beat.
        shutil.rmtree(paths.checkpoints, ignore_errors=True)
        run_trainer([*command, "--dry-run"], paths.metrics, settings.training.stall_timeout_s)
        publish(plan, paths, paths.checkpoints)
        return
    args = speculators_args(settings, plan, paths, captures)
    software = item_settings(settings.source, "train")["software"]
    reset_if_changed(paths, args, settings.training.epochs, software)
    drop_unfinished_epoch(paths.checkpoints)
    requests = 0
    with capture_server(settings, paths, split) as endpoint:
        run_trainer(with_endpoint(command, endpoint), paths.metrics, settings.training.stall_timeout_s)
        if endpoint is not None:
            requests = capture_requests(endpoint)
            log(f"the capture server answered {requests} requests for rows past the disk budget")
    publish(plan, paths, chosen_epoch(paths.checkpoints), split, requests)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, help=SETTINGS_HELP)
    parser.add_argument("--dataset", required=True, type=Path, help="prepared dataset directory")
    parser.add_argument("--hidden-states", required=True, type=Path, help="directory of hs_<row>.safetensors")
    parser.add_argument("--staging", required=True, type=Path, help="checkpoints and partial work")
    parser.add_argument("--output", required=True, type=Path, help="drafter directory to publish")
    parser.add_argument("--granted-gpus", type=int, default=None)
    parser.add_argument(
        "--untrained", action="store_true", help="publish the initialized, untrained drafter (an evaluation baseline)"
    )
    args = parser.parse_args(argv)
    # A SIGTERM (Snakemake, SLURM) unwinds through run_trainer's finally, which stops the trainer.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    paths = TrainPaths(args.dataset, args.hidden_states, args.staging, args.output)
    stage = "untrained_drafter" if args.untrained else "train"
    run(read_settings(args.settings, stage), paths, args.granted_gpus, args.untrained)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
