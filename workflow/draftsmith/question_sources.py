"""Where questions come from: any common conversation source read as deduplicated
questions with stable ids (the questions stage's pool, the evaluation's sets, the preflight's
first-row check).

Reads a Hugging Face dataset id (through `datasets`) or local JSONL / JSON / Parquet
files whose rows hold ``messages`` (role/content), ``conversations`` (from/value) or a
plain ``prompt``. A question is the conversation's leading system turns and its user turns:
the first one (``questions.turns: first``) or every one (``all``); the source's assistant
turns are dropped, the target writes each answer later (``generate``). A conversation that
starts with assistant turns (ShareGPT split long ones into parts) keeps the rest from its
first user turn, and is counted (``leading_assistant_turns_skipped``), not dropped.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.conversation_turns import first_prompt
from draftsmith.errors import DraftsmithError
from draftsmith.prompt_length import PromptLimit
from draftsmith.run_config import FIRST

LOCAL_SUFFIXES = {".jsonl", ".json", ".parquet"}
USER_ROLES = {"user", "human"}
TOO_LONG = "too long"  # the count of prompts over the limit (also a bad row with its reason)
# ShareGPT names some assistants by product (chatgpt, bing, bard).
ASSISTANT_ROLES = {"assistant", "gpt", "model", "bot", "chatgpt", "bing", "bard"}
LEADING_SKIPPED = "leading assistant turns skipped"  # a count, not a bad row


class QuestionsError(DraftsmithError):
    pass


@dataclass(frozen=True)
class Question:
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content), roles: system | user; one user turn per answer

    @property
    def user_turns(self) -> int:
        return sum(role == "user" for role, _ in self.messages)

    def chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "messages": self.chat()}, ensure_ascii=False)


class BadRow(ValueError):
    """A row that cannot become a question; the message is the reason counted."""


def _turns(row: Any) -> list[Any]:
    if not isinstance(row, dict):
        raise BadRow("row is not an object")
    for key in ("messages", "conversations"):
        value = row.get(key)
        if isinstance(value, list) and value:
            return value
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt:
        return prompt
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    raise BadRow("no messages, conversations or prompt field")


def _role_and_content(turn: Any) -> tuple[str, Any]:
    if isinstance(turn, str):  # a list of plain strings (MT-Bench's "prompt"): user turns
        return "user", turn
    if not isinstance(turn, dict):
        raise BadRow("a turn is not an object")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    return str(role).lower(), content


def prompt_turns(row: Any, turns: str = FIRST) -> tuple[tuple[str, str], ...]:
    """The question of a conversation: its leading system turns, then its first user turn
    (``first``) or each of its user turns (``all``), as (role, content). See ``conversation``."""
    return conversation(row, turns)[0]


def conversation(row: Any, turns: str = FIRST) -> tuple[tuple[tuple[str, str], ...], bool]:
    """The question's turns, and whether assistant turns before the first user text were
    skipped. Empty turns are skipped; user messages with no reply between them are one turn
    (templates that insist on alternating roles refuse two), except in a list of plain
    strings (MT-Bench's), where each string is a turn; a system turn after the first user
    turn is dropped (most templates accept one only first)."""
    messages: list[tuple[str, str]] = []
    waiting: list[str] = []  # user text since the last assistant turn
    leading_skipped = False
    for turn in _turns(row):
        role, content = _role_and_content(turn)
        if role in ASSISTANT_ROLES:
            if waiting:
                messages.append(("user", "\n\n".join(waiting)))
                waiting = []
                if turns == FIRST:
                    break
            leading_skipped = leading_skipped or not any(r == "user" for r, _ in messages)
            continue
        if role not in USER_ROLES and role != "system":
            continue
        if not isinstance(content, str):
            raise BadRow(f"{role} turn content is not text")
        content = content.strip()
        if not content:
            continue
        if role in USER_ROLES:
            if turns == FIRST:  # the first user turn alone, as it always was
                messages.append(("user", content))
                break
            if isinstance(turn, str) and waiting:  # a plain string is a turn of its own
                messages.append(("user", "\n\n".join(waiting)))
                waiting = []
            waiting.append(content)
        elif not waiting and not any(r == "user" for r, _ in messages):
            messages.append(("system", content))
    if waiting:
        messages.append(("user", "\n\n".join(waiting)))
    if not any(role == "user" for role, _ in messages):
        raise BadRow("no user turn")
    return tuple(messages), leading_skipped


def content_hash(messages: tuple[tuple[str, str], ...]) -> str:
    """Hash of the normalized prompt: NFC, whitespace runs collapsed. Stable across runs."""
    normalized = [[role, " ".join(unicodedata.normalize("NFC", content).split())] for role, content in messages]
    payload = json.dumps(normalized, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _read_jsonl(path: Path) -> Iterator[Any]:
    # Read line by line ourselves: one malformed line must count as a bad row,
    # where `datasets`' JSON reader would abort the whole file.
    with path.open("rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            try:
                yield json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield BadRow("invalid UTF-8")
            except json.JSONDecodeError:
                yield BadRow("malformed JSON line")


def _read_json_array(path: Path, source: str) -> Iterator[Any]:
    """The rows of a JSON array, one at a time: ShareGPT's file is 125 MB and more in memory
    as Python objects (ijson parses it as a stream; the json module cannot). A file that
    ends inside a record (ShareGPT's as shipped) or breaks off into malformed JSON yields
    the rows before that, and one bad row saying why the rest was not read."""
    import ijson

    with path.open("rb") as handle:
        start = handle.read(64).lstrip()[:1]
        if start != b"[":
            raise QuestionsError(f"{source} must hold a JSON array of rows; fix the file or use JSONL")
        handle.seek(0)
        try:
            yield from ijson.items(handle, "item", use_float=True)
        except ijson.JSONError as error:
            cut_off = "premature EOF" in str(error)
            yield BadRow("file ends inside a record (cut off)" if cut_off else "malformed JSON: the rest of the file")


def is_local_source(source: str) -> bool:
    """A local file or dataset directory, not a hub id: a file suffix, or a path no hub id
    (``name`` or ``owner/name``) looks like. A missing local path is an error, never a hub
    lookup."""
    return (
        Path(source).suffix.lower() in LOCAL_SUFFIXES
        or source.startswith(("/", "./", "../", "~"))
        or source.count("/") > 1
    )


def read_rows(source: str, split: str = "train", subset: str | None = None) -> Iterator[Any]:
    """Rows of a local file or a Hugging Face dataset; undecodable rows come as BadRow."""
    path = Path(source).expanduser()
    if is_local_source(source) and not path.is_dir():  # a local dataset directory: datasets reads it
        if not path.is_file():
            raise QuestionsError(f"question source {source} does not exist; fix questions.source")
        if path.suffix.lower() not in LOCAL_SUFFIXES:
            raise QuestionsError(
                f"question source {source} is not .jsonl, .json or .parquet; convert it or fix questions.source"
            )
        if path.stat().st_size == 0:
            raise QuestionsError(f"question source {source} is empty; point questions.source at a file with questions")
        if path.suffix.lower() == ".jsonl":
            yield from _read_jsonl(path)
            return
        if path.suffix.lower() == ".json":
            yield from _read_json_array(path, source)
            return
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
        return
    from datasets import load_dataset

    try:
        yield from load_dataset(source, name=subset, split=split, streaming=True)
    except (OSError, ValueError) as error:  # unreachable or offline (ConnectionError), no such id, split or subset
        raise QuestionsError(hub_problem(source, error)) from error


def hub_problem(source: str, error: Exception) -> str:
    """One line for a hub dataset that cannot be read, with the fix."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (
        f"cannot read {source} from the Hugging Face hub ({type(error).__name__}: {reason}); check the id, "
        "split and subset, or point the source at a local copy in the hub's layout (a directory of the "
        "dataset repository's files)"
    )


def first_row_problem(source: str, split: str = "train", subset: str | None = None) -> str | None:
    """Why the first row of ``source`` cannot be read, or None."""
    try:
        next(iter(read_rows(source, split, subset)), None)
    except DraftsmithError as error:
        return str(error)
    return None


def collect_questions(
    rows: Iterable[Any],
    limit: int | None,
    kept_rows: list[Any] | None = None,
    prompt_limit: PromptLimit | None = None,
    turns: str = FIRST,
) -> tuple[list[Question], Counter[str]]:
    """Deduplicated questions in source order, and counts of what was dropped and why.
    ``kept_rows``, if given, receives the source row of each question (its other fields).
    A first prompt longer than ``prompt_limit`` is a bad row with the limit's reason, counted
    before ``limit``: the limit is on questions that can be answered. Later turns are asked
    while they fit (``generate``)."""
    counts: Counter[str] = Counter[str]()
    seen: set[str] = set()
    questions: list[Question] = []
    for row in rows:
        counts["rows"] += 1
        try:
            if isinstance(row, BadRow):
                raise row
            messages, leading_skipped = conversation(row, turns)
        except BadRow as bad:
            counts[f"bad: {bad}"] += 1
            continue
        digest = content_hash(messages)
        if digest in seen:
            counts["duplicates"] += 1
            continue
        seen.add(digest)
        question = Question(f"q{digest[:16]}", messages)
        if prompt_limit is not None and not prompt_limit.fits(first_prompt(question.chat())):
            counts[f"bad: {prompt_limit.reason}"] += 1
            counts[TOO_LONG] += 1
            continue
        questions.append(question)
        counts[LEADING_SKIPPED] += leading_skipped
        if kept_rows is not None:
            kept_rows.append(row)
        if limit is not None and len(questions) >= limit:
            break
    return questions, counts
