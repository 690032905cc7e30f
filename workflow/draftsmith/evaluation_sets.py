"""The prompts the evaluation measures: the held-out split and the named sets of ``evaluation.sets``.

Each set is read by the same readers as ``questions.source`` (messages, conversations or
prompt; JSONL, JSON, Parquet, a local dataset directory or a hub id); ``prompt_field``
names another field that holds the question (GSM8K's ``question``). A set may name a
``category_field``: its value splits the set's results (chat, code, math...). The held-out
split is always the set ``heldout``, with no categories.

Output: one JSONL file, one prompt per line: ``{"set", "category", "id", "messages"}``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_write_text
from draftsmith.cli import SETTINGS_HELP, read_settings
from draftsmith.errors import DraftsmithError
from draftsmith.progress import log
from draftsmith.questions import collect_questions, read_rows
from draftsmith.run_config import EvaluationSetSettings, RunConfig

HELDOUT = "heldout"
NO_CATEGORY = "all"
WHOLE_SET = "*"  # the category of a result row that covers its whole set


class EvaluationSetError(DraftsmithError):
    pass


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """The prompts file this module writes."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _as_prompt(row: Any, field: str) -> Any:
    return {**row, "prompt": row.get(field)} if isinstance(row, dict) else row


def _category(row: dict[str, Any], field: str | None) -> str:
    value = row.get(field) if field else None
    return NO_CATEGORY if value in (None, "") else str(value)


def set_prompts(name: str, spec: EvaluationSetSettings) -> list[dict[str, Any]]:
    """The prompts of one configured set, deduplicated, with their categories."""
    rows: list[Any] = []
    try:
        source = read_rows(spec.source, spec.split, spec.subset)
        if spec.prompt_field:  # benchmark sets keep the question under their own name
            source = (_as_prompt(row, spec.prompt_field) for row in source)
        questions, counts = collect_questions(source, spec.limit, kept_rows=rows)
    except DraftsmithError as error:
        raise EvaluationSetError(f"evaluation.sets.{name}: {error}") from error
    field = spec.category_field
    prompts = [
        {"set": name, "category": _category(row, field), **json.loads(question.to_json())}
        for question, row in zip(questions, rows, strict=True)
    ]
    if not prompts:
        raise EvaluationSetError(
            f"evaluation.sets.{name} ({spec.source}) holds no usable prompt ({counts['rows']} rows read); "
            "rows need messages, conversations or prompt with a user turn"
        )
    return prompts


def heldout_prompts(path: Path, limit: int | None) -> list[dict[str, Any]]:
    prompts = [{"set": HELDOUT, "category": NO_CATEGORY, **row} for row in read_prompts(path)]
    if not prompts:
        raise EvaluationSetError(f"{path} holds no held-out questions; set questions.heldout ≥ 1")
    return prompts[:limit] if limit else prompts


def run(settings: RunConfig, heldout: Path, output: Path) -> dict[str, Counter[str]]:
    evaluation = settings.evaluation
    prompts = heldout_prompts(heldout, evaluation.limit)
    for name, spec in evaluation.sets.items():
        prompts += set_prompts(name, spec)
    atomic_write_text(output, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    sizes: dict[str, Counter[str]] = {}
    for prompt in prompts:
        sizes.setdefault(prompt["set"], Counter())[prompt["category"]] += 1
    for name, counts in sizes.items():
        detail = ", ".join(f"{category} {n}" for category, n in sorted(counts.items()))
        log(f"set {name}: {sum(counts.values())} prompts ({detail})")
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, help=SETTINGS_HELP)
    parser.add_argument("--heldout", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args(argv)
    run(read_settings(args.settings, "evaluation_sets"), args.heldout, args.output)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
