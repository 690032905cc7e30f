"""Extraction stage: hidden states of one shard of the prepared dataset, from vLLM.

    python -m draftsmith.extract --settings '{"target": ..., "server": ..., "layers": ...,
        "extraction": ..., "device": ...}' --dataset DATASET_DIR --shard I --num-shards N
        --staging STAGING_DIR --output OUTPUT_DIR [--granted-gpus G] [--captures DIR ...]

Shard I of N is a contiguous range of the stored dataset rows: all rows, or the leading
rows that fit ``hidden_states.disk_budget`` (``disk_budget``; training captures the rest,
and staged rows past the budget are deleted). One vLLM server (extraction mode)
is started for the whole shard; every row is requested once, its file is checked by
the gate (``shard_gate``) and moved to ``STAGING/hs_<row>.safetensors``. A restart
skips rows whose staged file passes the gate, and takes rows another shard's staging
holds (made under the same settings), so a re-sharding requests nothing again. Only
when every row is staged and the whole shard passes the gate again are the files
published: hard-linked (no bytes copied) into a fresh sibling of ``--output`` that is
then renamed to ``--output`` in one step, so the output directory appears complete or
not at all, and the staged copy survives Snakemake deleting the output before a rerun.

In one pass (``hidden_states.capture: during_generation``, ``--captures`` naming the
generation shards' staging directories) the rows generation captured are linked into the
staging first (``one_pass.adopt_captures``); only the others are requested, and a shard whose
every row was captured starts no server.

The order of the work, the retries and the error budget (none: every row must be there)
are those of every server stage (``server_stage``); what is this stage's own is below.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import openai
from datasets import Dataset, load_from_disk

from draftsmith.atomic import publish_directory
from draftsmith.capture_server import VLLM_STORAGE_DIR, SampleShape, extraction_server_args, target_shape
from draftsmith.cli import SETTINGS_HELP, read_settings
from draftsmith.client import SPECULATORS_CLIENT
from draftsmith.disk_budget import row_split
from draftsmith.layers import LayerPlan
from draftsmith.layout import HIDDEN_STATE_GLOB, ROW_IDS, hidden_state_file, hidden_state_row
from draftsmith.one_pass import CaptureOutcomes, adopt_captures
from draftsmith.progress import Progress, log
from draftsmith.records import RowIds, ShardManifest
from draftsmith.run_config import RunConfig
from draftsmith.server import Endpoint, ServerSpec
from draftsmith.server_stage import RequestPolicy, ServerStage, StageError, first_errors
from draftsmith.shard_gate import BadSample, check_shard
from draftsmith.staging import fingerprint_of, matching_siblings

# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [
    ("speculators.data_generation.vllm_client", "generate_hidden_states_async"),
    ("speculators.data_generation.vllm_client", "wait_for_lock_async"),
]

# How often a finished row's file lock is tried (speculators' default: 0.1 s).
LOCK_POLL_S = 0.01


class ExtractionError(StageError):
    """The shard could not be completed; the message says what failed and what to do."""


def extraction_stage(settings: RunConfig) -> ServerStage[int]:
    """The skeleton's parts for this stage; its items are dataset rows."""
    policy = RequestPolicy.from_section(settings.extraction)
    return ServerStage("extract", settings, policy, "rows", name=row_name, error=ExtractionError)


def row_name(row: int) -> str:
    return f"row {row}"


@dataclass
class ExtractionResult:
    """What one run did: ``requested`` lists the rows sent to the server this run."""

    rows: range
    skipped: int = 0
    requested: list[int] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)


class ShardRows(Mapping[int, list[int]]):
    """Row index -> token ids, read lazily from the Arrow dataset (shards can be large)."""

    def __init__(self, dataset: Dataset, rows: range):
        self._dataset = dataset
        self.rows = rows

    def __getitem__(self, row: int) -> list[int]:
        if row not in self.rows:
            raise KeyError(row)
        return self._dataset[row]["input_ids"]

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def shard_range(num_rows: int, shard: int, num_shards: int) -> range:
    """Contiguous rows of shard ``shard``; sizes differ by at most one."""
    if not 0 <= shard < num_shards:
        raise ExtractionError(f"--shard {shard} must be in 0..{num_shards - 1} (--num-shards)")
    size, remainder = divmod(num_rows, num_shards)
    start = shard * size + min(shard, remainder)
    return range(start, start + size + (1 if shard < remainder else 0))


def load_shard(dataset_dir: Path, shard: int, num_shards: int, stored: int | None = None) -> ShardRows:
    """Shard ``shard`` of the first ``stored`` rows (all rows by default)."""
    dataset = load_from_disk(str(dataset_dir))
    if "input_ids" not in dataset.column_names:
        raise ExtractionError(
            f"dataset {dataset_dir} has no input_ids column (has {dataset.column_names}); "
            "pass the directory written by `speculators prepare-data`"
        )
    # prepare-data saves torch format; plain lists compare directly with file token ids.
    rows = len(dataset) if stored is None else stored
    return ShardRows(dataset.with_format(None), shard_range(rows, shard, num_shards))


def check_settings(settings: RunConfig, rows: ShardRows) -> None:
    """Fail before the (slow) model load on what would fail every request later."""
    server = settings.server
    if settings.device == "cpu" and server.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in server.env:
        raise ExtractionError(
            "device cpu with tensor_parallel_size > 1 needs server.env "
            'VLLM_CPU_OMP_THREADS_BIND (one core set per rank, e.g. "0|1")'
        )
    limit = server.max_model_len
    if limit:
        longest = max(rows.rows, key=lambda row: len(rows[row]), default=None)
        if longest is not None and len(rows[longest]) + 1 > limit:
            raise ExtractionError(
                f"row {longest} has {len(rows[longest])} tokens but server.max_model_len is "
                f"{limit}; raise it above the dataset's seq_length"
            )


def rows_to_request(staging: Path, rows: ShardRows, shape: SampleShape) -> list[int]:
    """Resume: rows whose staged file is missing or fails the gate (bad files are removed)."""
    todo, corrupt = [], {}
    for row in rows:
        path = hidden_state_file(staging, row)
        if not path.exists():
            todo.append(row)
            continue
        try:
            shape.check(path, rows[row])
        except BadSample as error:
            corrupt[row] = str(error)
            path.unlink()
            todo.append(row)
    skipped = len(rows) - len(todo)
    log(f"resume: {skipped} of {len(rows)} rows already staged and valid, {len(todo)} to request")
    if corrupt:
        log(f"resume: removed {len(corrupt)} staged file(s) that failed the gate: {first_errors(corrupt, row_name)}")
    return todo


def adopt_from_other_shards(staging: Path, rows: ShardRows) -> int:
    """Link into this staging the rows another shard's staging holds (after a re-sharding);
    ``rows_to_request`` then gates them like any staged file."""
    siblings = matching_siblings(staging)
    adopted = 0
    for row in rows if siblings else []:
        mine = hidden_state_file(staging, row)
        if mine.exists():
            continue
        for sibling in siblings:
            if hidden_state_file(sibling, row).exists():
                os.link(hidden_state_file(sibling, row), mine)
                adopted += 1
                break
    if adopted:
        log(f"reused {adopted} rows staged by other shards under the same settings")
    return adopted


def _discard(path: str) -> None:
    for leftover in (path, path + ".lock"):
        if os.path.exists(leftover):
            os.remove(leftover)


async def _extract_one(
    client: openai.AsyncOpenAI,
    endpoint: Endpoint,
    row: int,
    token_ids: list[int],
    staging: Path,
    shape: SampleShape,
    timeout_s: float,
    in_flight: asyncio.Semaphore,
) -> None:
    # speculators' own client (imported while the server loaded): the completions request
    # with token ids, max_tokens=1 and the prompt-token check; retries are ours (below),
    # so it gets max_retries=0.
    from speculators.data_generation.vllm_client import generate_hidden_states_async, wait_for_lock_async

    # Only the request counts against the concurrency. The engine writes the file after
    # the response, so the lock wait below takes ~0.1 s; holding a request slot through
    # it halved the rate (81 vs 134-155 rows/s on the demo).
    async with in_flight:
        vllm_path, _ = await generate_hidden_states_async(
            client, endpoint.model, {"input_ids": token_ids}, timeout=timeout_s, max_retries=0
        )
    try:
        if os.path.exists(vllm_path + ".lock"):
            await wait_for_lock_async(vllm_path + ".lock", timeout=timeout_s, poll_interval=LOCK_POLL_S)
        await asyncio.to_thread(shape.check, Path(vllm_path), token_ids)
        os.replace(vllm_path, hidden_state_file(staging, row))
    finally:
        _discard(vllm_path)


async def extract_rows(
    stage: ServerStage[int],
    endpoint: Endpoint,
    rows: ShardRows,
    todo: list[int],
    staging: Path,
    shape: SampleShape,
) -> dict[int, str]:
    """Request every row in ``todo``; return row -> failure reason."""
    policy = stage.policy
    progress = Progress("extract", len(rows), already_done=len(rows) - len(todo))
    in_flight = asyncio.Semaphore(policy.concurrency)  # requests the server has
    # The key-protected server needs our key: `speculators generate-offline-data`
    # hard-codes api_key="EMPTY", so its client functions are used as a library here.
    # Its logger reports every final failure as "timed out"; failures are reported here.
    logging.getLogger("speculators.data_generation.vllm_client").setLevel(logging.CRITICAL)
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:

        async def extract(row: int) -> None:
            await _extract_one(client, endpoint, row, rows[row], staging, shape, policy.timeout_s, in_flight)

        # Rows between request and staged file (waiting for the lock, gated) are bounded
        # separately, so that a big shard's token ids are not all read at once.
        return await stage.request_all(todo, extract, progress, admitted=4 * policy.concurrency)


def drop_rows_past_the_budget(staging: Path, stored: int) -> None:
    """A smaller disk budget than the staged work was made under: the rows past it go
    (training captures them), so the disk holds what the budget allows."""
    past = [path for path in staging.glob(HIDDEN_STATE_GLOB) if hidden_state_row(path) >= stored]
    for path in past:
        path.unlink()
    if past:
        log(f"deleted {len(past)} staged rows past the disk budget ({stored} rows stored)")


def publishing_dir(output: Path) -> Path:
    return output.with_name(f".{output.name}.publishing")


def _recover_interrupted_publish(fresh: Path, staging: Path) -> None:
    """A crash before the final rename leaves links in ``fresh``; the staged files are
    intact, except a file only there (moved by an older release), which goes back."""
    if not fresh.exists():
        return
    for path in fresh.glob(HIDDEN_STATE_GLOB):
        if not (staging / path.name).exists():
            os.replace(path, staging / path.name)
    shutil.rmtree(fresh)
    log(f"removed the unfinished publish in {fresh}")


def manifest(
    rows: ShardRows, plan: LayerPlan, shape: SampleShape, staging: Path, items: str, stored: int
) -> ShardManifest:
    return ShardManifest(
        items_fingerprint=items,
        rows=[rows.rows.start, rows.rows.stop],
        num_rows=len(rows),
        config_layers=list(plan.config_layers),
        vllm_layer_ids=plan.vllm_ids,
        num_layers=plan.num_layers,
        hidden_size=shape.row.hidden_size,
        dtype=shape.row.stored_dtype,
        num_tokens=sum(len(rows[row]) for row in rows),
        bytes=sum(hidden_state_file(staging, row).stat().st_size for row in rows),
        stored_rows=stored,
    )


def publish(staging: Path, output: Path, rows: ShardRows, info: ShardManifest) -> None:
    """Hard-link the staged files into a fresh sibling of ``output``, then rename it into
    place. Links copy no bytes, and the staged names keep the files when Snakemake deletes
    the output before a rerun (a rerun then requests nothing again)."""
    fresh = publishing_dir(output)
    fresh.mkdir(parents=True)
    for row in rows:
        try:
            os.link(hidden_state_file(staging, row), hidden_state_file(fresh, row))
        except OSError as error:
            raise ExtractionError(
                f"cannot link staged files into {fresh} ({error}); staging and output must "
                "be on the same filesystem, one that supports hard links"
            ) from error
    info.write(fresh)
    publish_directory(fresh, output)


def adopt_captured_rows(
    settings: RunConfig, dataset_dir: Path, staging: Path, rows: ShardRows, captures: Sequence[Path]
) -> CaptureOutcomes | None:
    """One pass: stage the rows generation captured (``one_pass``); None when capture is separate."""
    if not settings.hidden_states.during_generation:
        return None
    row_ids = RowIds.read(dataset_dir)
    if row_ids is None:
        raise ExtractionError(f"{dataset_dir} has no {ROW_IDS}; rerun the dataset stage")
    outcomes = CaptureOutcomes(staging)
    outcomes.update(adopt_captures(staging, rows, row_ids.ids, captures))
    return outcomes


def run(
    settings: RunConfig,
    dataset_dir: Path,
    shard: int,
    num_shards: int,
    staging: Path,
    output: Path,
    granted_gpus: int | None = None,
    captures: Sequence[Path] = (),
) -> ExtractionResult:
    """Extract, resume, gate and publish one shard; raise ``ExtractionError`` if incomplete."""
    stage = extraction_stage(settings)
    stage.begin(granted_gpus, staging)
    plan, shape = target_shape(settings)
    split = row_split(dataset_dir, settings.hidden_states.limited_budget, shape.row)
    rows = load_shard(dataset_dir, shard, num_shards, split.stored)
    check_settings(settings, rows)
    log(
        f"shard {shard}/{num_shards}: rows {rows.rows.start}..{rows.rows.stop - 1} ({split.describe()}), "
        f"vLLM layer ids {plan.vllm_ids}, hidden {shape.row.hidden_size}, stored as {shape.row.stored_dtype}"
    )
    _recover_interrupted_publish(publishing_dir(output), staging)
    drop_rows_past_the_budget(staging, split.stored)
    adopt_from_other_shards(staging, rows)
    storage = staging / VLLM_STORAGE_DIR
    shutil.rmtree(storage, ignore_errors=True)  # leftovers of a killed server
    storage.mkdir()

    outcomes = adopt_captured_rows(settings, dataset_dir, staging, rows, captures)
    todo = rows_to_request(staging, rows, shape)
    result = ExtractionResult(rows.rows, skipped=len(rows) - len(todo), requested=todo)
    if todo:
        spec = ServerSpec.from_config(settings, extra_args=extraction_server_args(plan, storage, shape))
        with stage.server(spec, SPECULATORS_CLIENT) as endpoint:
            result.failures = asyncio.run(extract_rows(stage, endpoint, rows, todo, staging, shape))
    kept = "Staged rows are kept; rerun to retry only the missing ones"
    stage.check_failures(result.failures, len(rows), kept)
    # Every staged file was gated once in this run: found ones by rows_to_request, requested
    # ones as _extract_one staged them. What is left to check is that none is missing.
    check_shard(staging, rows, shape.row.num_layers, shape.row.hidden_size, shape.stored_dtype, rows.rows)
    items = fingerprint_of(stage.items)
    info = manifest(rows, plan, shape, staging, items, split.stored)
    if outcomes is not None:
        info = dataclasses.replace(info, captured_during_generation=outcomes.counts())
    publish(staging, output, rows, info)
    shutil.rmtree(storage)
    log(f"published {len(rows)} samples to {output}")
    return result


def shard_command(
    settings: str, dataset: Path, staging: Path, output: Path, shard: int = 0, num_shards: int = 1
) -> list[str]:
    """This stage's command line for one shard, as the extract rule runs it; for runs by hand
    (the tests', the resume bench's). ``settings``: as ``--settings`` takes it."""
    flags = {"--settings": settings, "--dataset": dataset, "--shard": shard, "--num-shards": num_shards}
    flags |= {"--staging": staging, "--output": output}
    return [sys.executable, "-m", "draftsmith.extract", *(str(part) for flag in flags.items() for part in flag)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m draftsmith.extract",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--settings", required=True, help=SETTINGS_HELP)
    parser.add_argument("--dataset", required=True, type=Path, help="prepare-data output")
    parser.add_argument("--shard", required=True, type=int)
    parser.add_argument("--num-shards", required=True, type=int)
    parser.add_argument("--staging", required=True, type=Path, help="resumable work dir")
    parser.add_argument("--output", required=True, type=Path, help="published shard dir")
    parser.add_argument("--granted-gpus", type=int, default=None, help="what Snakemake granted")
    parser.add_argument(
        "--captures", nargs="*", type=Path, default=[], help="one pass: the generation shards' staging dirs"
    )
    args = parser.parse_args(argv)
    run(
        read_settings(args.settings, "extract"),
        args.dataset,
        args.shard,
        args.num_shards,
        args.staging,
        args.output,
        args.granted_gpus,
        args.captures,
    )


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
