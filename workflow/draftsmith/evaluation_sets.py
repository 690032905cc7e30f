"""The prompts the evaluation measures: the held-out split and the named sets of ``evaluation.sets``.

Each set is read by the same readers as ``questions.source`` (messages, conversations or
prompt; JSONL, JSON, Parquet, a local dataset directory or a hub id); ``prompt_field``
names another field that holds the question (GSM8K's ``question``). A set may name a
``category_field``: its value splits the set's results (chat, code, math...). The held-out
split is always the set ``heldout``, with no categories.

Every prompt must leave room for ``evaluation.max_tokens`` in the server's context
(``prompt_length.py``): those that do not are dropped here and counted, so no measurement
asks what the server would refuse after its load.

A conversation may hold several user turns (``questions.turns: all``; MT-Bench's shape is a
list of user turns): the evaluation sends them in order, each after the target's answer to
the one before, and measures every turn. Its later turns are kept while they fit with every
earlier answer at ``evaluation.max_tokens`` (the answers are not known yet, and every server
compared must get the same turns); the turns dropped are counted.

Outputs: one JSONL file, one prompt per line: ``{"set", "category", "id", "messages"}``; and
a summary per set (rows read, duplicates, dropped by reason, prompts by category).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_write_text
from draftsmith.cli import read_settings, stage_parser
from draftsmith.conversation_turns import Chat, user_turns
from draftsmith.errors import DraftsmithError
from draftsmith.progress import log
from draftsmith.prompt_length import PromptLimit, prompt_limit
from draftsmith.question_sources import TOO_LONG, collect_questions, read_rows
from draftsmith.records import HELDOUT, NO_CATEGORY, read_prompts
from draftsmith.run_config import FIRST, EvaluationSetSettings, RunConfig

SetCounts = dict[str, Any]  # rows read, duplicates, dropped by reason; then prompts, by category


class EvaluationSetError(DraftsmithError):
    pass


def _as_prompt(row: Any, field: str) -> Any:
    return {**row, "prompt": row.get(field)} if isinstance(row, dict) else row


def _category(row: dict[str, Any], field: str | None) -> str:
    value = row.get(field) if field else None
    return NO_CATEGORY if value in (None, "") else str(value)


def answerable(messages: Chat, fitting: PromptLimit, answer_tokens: int) -> Chat | None:
    """The conversation's leading turns that fit the context, every answer at its longest;
    None when not even the first does."""
    users = [index for index, message in enumerate(messages) if message["role"] == "user"]
    if len(users) == 1:
        return messages if fitting.fits(messages) else None
    turns = fitting.answerable_turns(messages, answer_tokens)
    return messages[: users[turns - 1] + 1] if turns else None


def with_turns_that_fit(
    prompts: list[dict[str, Any]], fitting: PromptLimit | None, answer_tokens: int
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The prompts that fit, their later turns cut to what fits (``answerable``); the turns
    they keep and the later turns cut."""
    kept, cut = [], 0
    for prompt in prompts:
        messages = prompt["messages"] if fitting is None else answerable(prompt["messages"], fitting, answer_tokens)
        if messages is not None:
            kept.append({**prompt, "messages": messages})
            cut += user_turns(prompt["messages"]) - user_turns(messages)
    return kept, {"turns": sum(user_turns(prompt["messages"]) for prompt in kept), "later_turns_dropped": cut}


def set_prompts(
    name: str,
    spec: EvaluationSetSettings,
    fitting: PromptLimit | None = None,
    turns: str = FIRST,
    answer_tokens: int = 0,
) -> tuple[list[dict[str, Any]], SetCounts]:
    """The prompts of one configured set that fit the context, deduplicated, with their
    categories; and what was dropped, by reason. ``turns``: ``questions.turns``."""
    rows: list[Any] = []
    try:
        source = read_rows(spec.source, spec.split, spec.subset)
        if spec.prompt_field:  # benchmark sets keep the question under their own name
            source = (_as_prompt(row, spec.prompt_field) for row in source)
        questions, counts = collect_questions(source, spec.limit, kept_rows=rows, prompt_limit=fitting, turns=turns)
    except DraftsmithError as error:
        raise EvaluationSetError(f"evaluation.sets.{name}: {error}") from error
    field = spec.category_field
    prompts = [
        {"set": name, "category": _category(row, field), **json.loads(question.to_json())}
        for question, row in zip(questions, rows, strict=True)
    ]
    prompts, turn_counts = with_turns_that_fit(prompts, fitting, answer_tokens)
    dropped = {k.removeprefix("bad: "): n for k, n in counts.items() if k.startswith("bad: ")}
    if not prompts:
        raise EvaluationSetError(
            f"evaluation.sets.{name} ({spec.source}) holds no usable prompt ({counts['rows']} rows read, "
            f"{counts[TOO_LONG]} too long); rows need messages, conversations or prompt with a user turn "
            "that fits the context"
        )
    return prompts, {"rows_read": counts["rows"], "duplicates": counts["duplicates"], "dropped": dropped} | turn_counts


def heldout_prompts(
    path: Path, limit: int | None, fitting: PromptLimit, answer_tokens: int = 0
) -> tuple[list[dict[str, Any]], SetCounts]:
    """The held-out questions that fit the context at evaluation.max_tokens (the questions
    stage kept those that fit at generation.max_tokens), the first ``limit`` of them."""
    rows = read_prompts(path)
    if not rows:
        raise EvaluationSetError(f"{path} holds no held-out questions; set questions.heldout ≥ 1")
    everyone = [{"set": HELDOUT, "category": NO_CATEGORY, **row} for row in rows]
    prompts, turn_counts = with_turns_that_fit(everyone, fitting, answer_tokens)
    dropped = {fitting.reason: len(rows) - len(prompts)} if len(prompts) < len(rows) else {}
    if not prompts:
        raise EvaluationSetError(
            f"none of the {len(rows)} held-out questions fits: {fitting.reason}; "
            "lower evaluation.max_tokens or raise server.max_model_len"
        )
    if limit:
        prompts = prompts[:limit]
        turn_counts["turns"] = sum(user_turns(prompt["messages"]) for prompt in prompts)
    return prompts, {"rows_read": len(rows), "duplicates": 0, "dropped": dropped} | turn_counts


def run(settings: RunConfig, heldout: Path, output: Path, summary: Path) -> dict[str, Counter[str]]:
    evaluation = settings.evaluation
    fitting = prompt_limit(settings, "evaluation.max_tokens")
    prompts, held_out_counts = heldout_prompts(heldout, evaluation.limit, fitting, evaluation.max_tokens)
    counts = {HELDOUT: held_out_counts}
    for name, spec in evaluation.sets.items():
        kept, counts[name] = set_prompts(name, spec, fitting, settings.questions.turns, evaluation.max_tokens)
        prompts += kept
    atomic_write_text(output, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    sizes: dict[str, Counter[str]] = {}
    for prompt in prompts:
        sizes.setdefault(prompt["set"], Counter())[prompt["category"]] += 1
    for name, by_category in sizes.items():
        detail = ", ".join(f"{category} {n}" for category, n in sorted(by_category.items()))
        dropped = "".join(f"; dropped {n}: {reason}" for reason, n in counts[name]["dropped"].items())
        turns = counts[name]["turns"]
        cut = counts[name]["later_turns_dropped"]
        later = f"; {cut} later turns cut, no room for their answers" if cut else ""
        log(f"set {name}: {sum(by_category.values())} prompts, {turns} turns ({detail}){dropped}{later}")
        counts[name] |= {"prompts": sum(by_category.values()), "by_category": dict(sorted(by_category.items()))}
    record = {"max_prompt_tokens": fitting.max_tokens, "sets": counts}
    atomic_write_text(summary, json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(__doc__)
    parser.add_argument("--heldout", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--summary", required=True, type=Path)
    args = parser.parse_args(argv)
    run(read_settings(args.settings, "evaluation_sets"), args.heldout, args.output, args.summary)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
