"""Training's checkpoints: when they resume, when they start afresh, and which epoch is published.

Checkpoints live in the staging directory, outside the declared outputs, so a crash or a
Snakemake rerun keeps them: speculators resumes by itself from the newest epoch there.
Raising ``training.epochs`` continues from the last epoch; any other change of the
arguments, the software or the data starts afresh (``train_args.json`` remembers them). The
data is identified by content, not by file times, so republished but unchanged inputs resume.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from datasets import load_from_disk

from draftsmith.atomic import atomic_write_text
from draftsmith.drafter_publish import read_metric_records
from draftsmith.errors import TrainError
from draftsmith.layout import HIDDEN_STATE_GLOB, ROW_IDS, SHARD_MANIFEST, TOKEN_FREQUENCIES, TrainPaths
from draftsmith.progress import log


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
    (tokens, loss masks), row ids and token frequencies, and for the hidden states each row's file size and
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
    # The token counts choose the draft vocabulary: other counts, another output head.
    frequencies = paths.dataset / TOKEN_FREQUENCIES
    digest.update(frequencies.read_bytes() if frequencies.is_file() else b"no token frequencies")
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


def drop_unfinished_epoch(paths: TrainPaths) -> None:
    """The newest epoch counts only if its checkpoint is whole (training_state.json is written
    last) and the epoch was validated. speculators saves an epoch before validating it and
    resumes after it without validating it, so a kill in between lost that epoch's validation
    and its chance to be the published (best) epoch. Such an epoch goes and is trained again
    from the one before: checkpoints are exact (speculators_cpu), so it comes out the same."""
    epochs = epoch_dirs(paths.checkpoints)
    if not epochs:
        return
    newest = epochs[-1]
    if not (newest / "training_state.json").is_file():
        reason = "unfinished checkpoint"
    elif int(newest.name) not in read_metric_records(paths.metrics)[1]:
        reason = "checkpoint of an epoch whose validation did not finish"
    else:
        return
    log(f"removing {reason} {newest}")
    shutil.rmtree(newest)


def chosen_epoch(checkpoints: Path) -> Path:
    """The epoch with the lowest validation loss (speculators' checkpoint_best), else the newest."""
    best = checkpoints / "checkpoint_best"
    if best.is_dir():
        return best.resolve()
    epochs = epoch_dirs(checkpoints)
    if not epochs:
        raise TrainError(f"speculators train finished without a checkpoint in {checkpoints}")
    return epochs[-1]
