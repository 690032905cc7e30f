"""Dataset stage: merge the completion shards and run `speculators prepare-data` on them.

The rows are already tokenized (the target's own token ids with the loss mask
from generation), so prepare-data passes them through: it truncates to
``seq_length``, drops rows with too few trainable tokens, shuffles, writes the
Arrow dataset, and counts token frequencies for the draft vocabulary.

prepare-data drops every column but the tokens and shuffles, so we write ``row_ids.json``
beside it: the question id of every dataset row, found by matching each row's tokens and
loss mask with the answers it was made from (prepare-data has no column it carries through,
and replaying its shuffle and filters would tie us to its internals). Answers that
prepare-data cuts to the same row are the same training row; each of their ids is given to
one of those rows, so no id is lost or repeated. Extraction names its files by row, and
this keeps each row traceable to its question.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from draftsmith.atomic import publish_directory
from draftsmith.cli import read_settings, stage_parser
from draftsmith.errors import DraftsmithError
from draftsmith.layout import TOKEN_FREQUENCIES
from draftsmith.progress import log
from draftsmith.records import CapturedRows, GenerationRecord, RowIds
from draftsmith.run_config import RunConfig

SPECULATORS_CLI = [sys.executable, "-m", "speculators"]
# `speculators prepare-data` options prepare_data_command passes (its typer parameters).
PREPARE_DATA_PARAMETERS = [
    "model",
    "data",
    "output",
    "seq_length",
    "minimum_valid_tokens",
    "skip_token_freq",
    "token_freq_path",
    "overwrite",
    "trust_remote_code",
]


class DatasetError(DraftsmithError):
    pass


def answers_by_id(shards: list[Path]) -> list[tuple[str, Path, int]]:
    """(question id, shard, byte offset) of every answer, in question-id order.

    The merged rows go in this order, not in shard order: prepare-data's shuffle is
    seeded, so the same answers make the same dataset however the questions were
    sharded, and a re-sharding leaves every extracted row valid."""
    found = []
    for shard in shards:
        with shard.open("rb") as handle:
            offset = 0
            for line in handle:
                if line.strip():
                    found.append((json.loads(line)["id"], shard, offset))
                offset += len(line)
    return sorted(found)


def merge_completions(
    shards: list[Path], merged: Path, seq_length: int, one_pass: bool = False, dropped: Counter[int] | None = None
) -> tuple[dict[str, list[str]], set[str]]:
    """Write the answers, in question-id order, as one JSONL of ``input_ids``/``loss_mask`` rows.

    Returns the question ids of each row as prepare-data will write it (cut to
    ``seq_length``), keyed by ``row_key``, in question-id order; and the questions whose
    states generation captured. One pass: each row ends before its final answer token,
    the one token whose state the target never computed (``one_pass``); those tokens are
    counted in ``dropped``.
    """
    ids_by_row: dict[str, list[str]] = {}
    captured: set[str] = set()
    handles = {shard: shard.open("rb") for shard in shards}
    try:
        with merged.open("w", encoding="utf-8") as out:
            for question_id, shard, offset in answers_by_id(shards):
                handles[shard].seek(offset)
                record = GenerationRecord.from_json(handles[shard].readline().decode("utf-8"))
                input_ids, loss_mask = record.input_ids, record.loss_mask
                if one_pass:
                    if dropped is not None and loss_mask[-1]:
                        dropped[input_ids[-1]] += 1
                    input_ids, loss_mask = input_ids[:-1], loss_mask[:-1]
                if record.captured:
                    captured.add(question_id)
                ids_by_row.setdefault(row_key(input_ids[:seq_length], loss_mask[:seq_length]), []).append(question_id)
                row = {"input_ids": input_ids, "loss_mask": loss_mask}
                out.write(json.dumps(row) + "\n")
    finally:
        for handle in handles.values():
            handle.close()
    return ids_by_row, captured


def count_final_tokens(frequencies: Path, dropped: Counter[int]) -> None:
    """One pass: add the final answer tokens the rows leave out to prepare-data's counts.

    The draft vocabulary is the most frequent tokens of the rows. A row ends before its final
    answer token, which is almost always the end-of-turn token: uncounted, it fell out of the
    draft vocabulary, and the drafter could never propose the end of an answer. Every served
    answer ends with it, so the last verify step of every request was rejected at its first
    draft position (the demo's first-position acceptance 0.75 served against 0.86 validated:
    docs/evaluation.md). The drafter still learns to predict it: the row's last state is the
    one whose next token it is."""
    import torch

    counts = torch.load(frequencies)
    for token, count in dropped.items():
        counts[token] = counts.get(token, 0) + count
    torch.save(counts, frequencies)
    log(f"one pass: counted {sum(dropped.values())} final answer tokens the rows leave out ({len(dropped)} distinct)")


def row_key(input_ids: list[int], loss_mask: list[int]) -> str:
    return hashlib.sha256(json.dumps([list(input_ids), list(loss_mask)]).encode()).hexdigest()


def prepare_data_command(settings: RunConfig, merged: Path, output: Path) -> list[str]:
    dataset, target = settings.dataset, settings.target
    argv = [
        *SPECULATORS_CLI,
        "prepare-data",
        "--model",
        target.model,
        "--data",
        str(merged),
        "--output",
        str(output),
        "--seq-length",
        str(dataset.seq_length),
        "--minimum-valid-tokens",
        str(dataset.min_trainable_tokens),
        "--no-skip-token-freq",
        "--token-freq-path",
        str(output / TOKEN_FREQUENCIES),
        "--overwrite",
    ]
    if target.trust_remote_code:
        argv.append("--trust-remote-code")
    return argv


def row_question_ids(dataset_dir: Path, ids_by_row: dict[str, list[str]]) -> list[str]:
    """The question id of every row of the prepared dataset, in row order; each id once."""
    from datasets import load_from_disk

    unclaimed = {key: list(ids) for key, ids in ids_by_row.items()}
    rows = load_from_disk(str(dataset_dir)).with_format(None)
    result: list[str] = []
    for input_ids, loss_mask in zip(rows["input_ids"], rows["loss_mask"], strict=True):
        ids = unclaimed.get(row_key(input_ids, loss_mask))
        if not ids:
            raise DatasetError(f"dataset row {len(result)} matches no completion; rerun the dataset stage")
        result.append(ids.pop(0))
    return result


def captured_rows_first(prepared: Path, row_ids: list[str], captured: set[str], staging: Path) -> list[str]:
    """One pass: reorder the rows so those whose states generation captured come first
    (each group keeps prepare-data's shuffled order), and record how many there are. A disk
    budget stores leading rows, so it stores captured ones and requests nothing again."""
    from datasets import load_from_disk

    leading = [row for row, question in enumerate(row_ids) if question in captured]
    order = leading + [row for row, question in enumerate(row_ids) if question not in captured]
    if order != list(range(len(order))):
        reordered = staging / "reordered"
        shutil.rmtree(reordered, ignore_errors=True)
        load_from_disk(str(prepared)).select(order).save_to_disk(str(reordered))
        shutil.copy2(prepared / TOKEN_FREQUENCIES, reordered / TOKEN_FREQUENCIES)
        shutil.rmtree(prepared)
        reordered.rename(prepared)
        row_ids = [row_ids[row] for row in order]
    CapturedRows(captured=len(leading), rows=len(row_ids)).write(prepared)
    log(f"one pass: {len(leading)} of {len(row_ids)} rows have states captured during generation; they come first")
    return row_ids


def run(settings: RunConfig, completions: list[Path], staging: Path, output: Path) -> None:
    staging.mkdir(parents=True, exist_ok=True)
    merged = staging / "merged.jsonl"
    one_pass = settings.hidden_states.during_generation
    dropped: Counter[int] = Counter()
    ids_by_row, captured = merge_completions(completions, merged, settings.dataset.seq_length, one_pass, dropped)
    answers = sum(len(ids) for ids in ids_by_row.values())
    if not answers:
        raise DatasetError("the completion shards hold no answers; check the generation logs")
    log(f"merged {answers} answers from {len(completions)} shard(s)")

    prepared = staging / "prepared"
    shutil.rmtree(prepared, ignore_errors=True)  # a killed run's half-written dataset; cheap to redo
    command = prepare_data_command(settings, merged, prepared)
    log("running: " + " ".join(command))
    result = subprocess.run(command, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise DatasetError(f"speculators prepare-data failed (exit {result.returncode}); see the log above")

    row_ids = row_question_ids(prepared, ids_by_row)
    if dropped:
        count_final_tokens(prepared / TOKEN_FREQUENCIES, dropped)
    if one_pass:
        row_ids = captured_rows_first(prepared, row_ids, captured, staging)
    RowIds(row_ids).write(prepared)
    log(f"dataset: {len(row_ids)} rows ({answers - len(row_ids)} dropped by prepare-data)")
    publish_directory(prepared, output)


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(__doc__)
    parser.add_argument("--staging", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("completions", nargs="+", type=Path)
    args = parser.parse_args(argv)
    run(read_settings(args.settings, "dataset"), args.completions, args.staging, args.output)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
