"""Questions stage: any common conversation source -> deduplicated prompts with stable ids.

The source is read as questions by ``question_sources.py`` (any common conversation
layout, local or on the hub).

Each prompt is measured in the target's tokens: one that leaves no room for its answer
(``prompt_length.py``) is dropped here, counted as a bad row with its reason, so no later
stage asks a server what it would refuse.

Outputs: ``shard_<i>.jsonl`` training shards, ``heldout.jsonl`` for evaluation and
``summary.json`` with the counts (bad rows by reason, duplicates, too long, kept).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_write_text
from draftsmith.cli import read_settings, stage_parser
from draftsmith.layout import SUMMARY, heldout_file, shard_file
from draftsmith.progress import log
from draftsmith.prompt_length import prompt_limit
from draftsmith.question_sources import (
    LEADING_SKIPPED,
    TOO_LONG,
    Question,
    QuestionsError,
    collect_questions,
    read_rows,
)
from draftsmith.run_config import RunConfig


def _rank(question_id: str, seed: int, salt: str) -> int:
    return int(hashlib.sha256(f"{salt}:{seed}:{question_id}".encode()).hexdigest()[:16], 16)


def split_questions(
    questions: list[Question], heldout: int, shards: int, seed: int
) -> tuple[list[list[Question]], list[Question]]:
    """Deterministic held-out set and shards, by hash of (seed, id): a question stays in
    its shard when the pool grows, so finished generation work stays valid."""
    if heldout >= len(questions):
        raise QuestionsError(
            f"questions.heldout is {heldout} but only {len(questions)} usable questions exist; "
            "lower questions.heldout or add questions"
        )
    by_rank = sorted(questions, key=lambda q: _rank(q.id, seed, "heldout"))
    heldout_ids = {q.id for q in by_rank[:heldout]}
    train = [q for q in questions if q.id not in heldout_ids]
    shard_lists: list[list[Question]] = [[] for _ in range(shards)]
    for question in train:
        shard_lists[_rank(question.id, seed, "shard") % shards].append(question)
    return shard_lists, [q for q in questions if q.id in heldout_ids]


def write_jsonl(path: Path, questions: list[Question]) -> None:
    atomic_write_text(path, "".join(q.to_json() + "\n" for q in questions))


def run(settings: RunConfig, output_dir: Path) -> dict[str, Any]:
    section = settings.questions
    rows = read_rows(section.source, section.split, section.subset)
    fitting = prompt_limit(settings, "generation.max_tokens")
    questions, counts = collect_questions(rows, section.limit, prompt_limit=fitting, turns=section.turns)
    bad = {reason: n for reason, n in counts.items() if reason.startswith("bad: ")}
    for reason, n in sorted(bad.items()):
        log(f"skipped {n} row(s): {reason.removeprefix('bad: ')}")
    if not questions:
        raise QuestionsError(
            f"no usable questions in {section.source} ({counts['rows']} rows read, "
            f"{sum(bad.values())} bad, {counts[TOO_LONG]} of them {fitting.reason}); rows need messages, "
            "conversations or prompt with a user turn that fits the context"
        )
    shards, heldout = split_questions(questions, section.heldout, section.shards, section.seed)
    output_dir.mkdir(parents=True, exist_ok=True)
    for index, shard in enumerate(shards):
        write_jsonl(shard_file(output_dir, index), shard)
    write_jsonl(heldout_file(output_dir), heldout)
    summary = {
        "source": section.source,
        "rows_read": counts["rows"],
        "bad_rows": sum(bad.values()),
        "bad_rows_by_reason": {k.removeprefix("bad: "): v for k, v in bad.items()},
        "duplicates": counts["duplicates"],
        "max_prompt_tokens": fitting.max_tokens,
        "too_long": counts[TOO_LONG],
        # Conversations kept from their first user turn (the assistant turns before it are dropped).
        "leading_assistant_turns_skipped": counts[LEADING_SKIPPED],
        "questions": len(questions),
        "turns": section.turns,
        "train": sum(len(s) for s in shards),
        # User turns the target answers (fewer where a conversation outgrows the context).
        "train_turns": sum(q.user_turns for s in shards for q in s),
        "heldout": len(heldout),
        "shard_sizes": [len(s) for s in shards],
    }
    atomic_write_text(output_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    log(
        f"{summary['questions']} questions from {summary['rows_read']} rows "
        f"({summary['duplicates']} duplicates, {summary['bad_rows']} bad, {summary['too_long']} of them too long; "
        f"{summary['leading_assistant_turns_skipped']} kept from their first user turn): "
        f"{summary['train']} train with {summary['train_turns']} user turns in {len(shards)} shard(s), "
        f"{summary['heldout']} held out"
    )
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(__doc__)
    parser.add_argument("--output-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    run(read_settings(args.settings, "questions"), args.output_dir)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
