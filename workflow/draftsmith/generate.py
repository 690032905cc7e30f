"""Generation stage: the target answers one shard of questions, resumably, turn by turn.

A question is a conversation: leading system turns and one or more user turns
(``questions.turns``). The target answers user turn 1; its own answer goes into the
context, then it answers user turn 2, and so on while the next prompt leaves room for
``generation.max_tokens`` in ``server.max_model_len`` (measured with the target's tokenizer
before the request, as the questions stage measures the first). Each turn is one chat
completion with ``return_token_ids`` (speculators' request: prompt tokens masked 0,
generated tokens 1). The conversation's row is the last request's prompt and answer: the
whole conversation as the target saw it. Its loss mask covers every answer the target
wrote, carried from each turn's row to the next over the tokens the next prompt holds
verbatim (a template that rewrites earlier answers, e.g. strips their reasoning, leaves
only the rewritten part unmasked).

We do not call `speculators regenerate-responses` (or its ``regenerate_conversation``):
it cannot send an API key, it answers a whole conversation in one call (no resume between
turns, no stop at the context), and resume, the error budget and atomic publishing must
follow this workflow's rules:

- after every finished turn, the conversation so far is appended (and fsynced) to
  ``<staging>/records.jsonl``, outside the declared output, so a crash loses only the
  turns in flight; the last line of a question is its state;
- a rerun skips finished conversations and continues the others from their next turn;
- the shard is published to its output in one rename once all its conversations are
  finished, or the stage fails when more than ``max_error_fraction`` failed.

The order of the work, the retries and the error budget are those of every server
stage (``server_stage``); what is this stage's own is below.

In one pass (``hidden_states.capture: during_generation``) the server is an extraction
server too: the last turn's request holds the whole conversation, so its hidden states are
the row's and are staged with it (``one_pass.CaptureSpool``); earlier turns' are deleted.

The token ids are the model's own: reasoning stays wrapped in its think tags
exactly as generated (the hand-run scripts lost that wrapper).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_write_text
from draftsmith.capture_server import VLLM_STORAGE_DIR, extraction_server_args, target_shape
from draftsmith.cli import read_settings, stage_parser
from draftsmith.client import SPECULATORS_CLIENT, Poster, chat_poster, open_session
from draftsmith.conversation_turns import Chat, first_prompt, turn_messages, turn_requests, user_turns
from draftsmith.layout import GENERATION_RECORDS, SUMMARY
from draftsmith.one_pass import CaptureSpool, captured_state_file, discard_states
from draftsmith.progress import Progress, log
from draftsmith.prompt_length import PromptMeter
from draftsmith.records import CONTEXT_FULL, LAST_TURN, GenerationRecord
from draftsmith.run_config import RunConfig
from draftsmith.server import Endpoint, ServerSpec
from draftsmith.server_stage import RequestPolicy, ServerStage, StageError
from draftsmith.staging import matching_siblings

RECORDS = GENERATION_RECORDS
# Why a conversation ended (a record's "ended"; None while turns are left to ask).


class GenerationError(StageError):
    pass


def generation_stage(settings: RunConfig) -> ServerStage[str]:
    """The skeleton's parts for this stage; its items are question ids."""
    policy = RequestPolicy.from_section(settings.generation)
    return ServerStage("generate", settings, policy, "questions", error=GenerationError)


@dataclass
class GenerationTally:
    """What a generation run got: answers, those cut at max_tokens, and failed questions
    (the evaluation's per-request counts are ``evaluate.Tally``)."""

    ok: int = 0
    truncated: int = 0
    errors: dict[str, str] = field(default_factory=dict)  # question id -> last error


def read_questions(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def read_records(path: Path) -> dict[str, GenerationRecord]:
    """Finished answers by question id, leaving the file as it is (a torn last line is skipped)."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    records = map(GenerationRecord.from_json, complete.decode("utf-8").splitlines())
    return {record.id: record for record in records}


def load_records(path: Path) -> dict[str, GenerationRecord]:
    """This shard's finished answers. A torn last line (crash mid-write) is cut off, so
    later appends start on a clean line."""
    if path.exists():
        size, complete = path.stat().st_size, path.read_bytes().rfind(b"\n") + 1
        if complete != size:
            log(f"dropping a torn last line from {path} (interrupted write)")
            with path.open("r+b") as handle:
                handle.truncate(complete)
    return read_records(path)


def adopt_from_other_shards(
    staging: Path, questions: list[dict[str, Any]], staged: dict[str, GenerationRecord]
) -> None:
    """After a re-sharding, conversations of this shard's questions may sit in another
    shard's staging (made under the same settings): copy those further along than ours
    here, and into ``staged``, instead of asking their turns again."""
    wanted = {q["id"] for q in questions if not finished(staged.get(q["id"]))}
    adopted: dict[str, GenerationRecord] = {}
    for sibling in matching_siblings(staging) if wanted else []:
        for question_id, record in read_records(sibling / RECORDS).items():
            ours = adopted.get(question_id, staged.get(question_id))
            if question_id in wanted and (ours is None or record.turns > ours.turns):
                adopted[question_id] = record
    if adopted:
        writer = RecordWriter(staging / RECORDS)
        try:
            for record in adopted.values():
                writer.write(record)
        finally:
            writer.close()
        staged.update(adopted)
        log(f"reused {len(adopted)} conversations staged by other shards under the same settings")


@dataclass(frozen=True)
class Answer:
    """One turn's response: what the target was fed, what it wrote, and its text."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: str | None

    @classmethod
    def from_response(cls, data: dict[str, Any]) -> Answer:
        choice = data["choices"][0]
        prompt_ids, completion_ids = data.get("prompt_token_ids"), choice.get("token_ids")
        if not prompt_ids or not completion_ids:
            raise ValueError("endpoint returned no token ids; it must support return_token_ids")
        text = choice["message"].get("content")
        if not text:  # the next turn's context would hold an empty answer
            raise ValueError("empty assistant generation")
        return cls(prompt_ids, completion_ids, text, choice.get("finish_reason"))


def finished(record: GenerationRecord | None) -> bool:
    """A conversation with no turn left to ask."""
    return record is not None and record.finished


def next_turn_fits(settings: RunConfig, meter: PromptMeter | None, parts: list[Chat], answers: list[str]) -> bool:
    """Whether the next turn's prompt, after ``answers``, leaves room for its answer: the
    questions stage's limit. Without a meter (single-turn questions) nothing is measured."""
    return meter is None or meter.tokens(turn_messages(parts, answers)) <= settings.question_prompt_limit


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def with_answer(question_id: str, record: GenerationRecord | None, answer: Answer) -> GenerationRecord:
    """The conversation's record after one more turn: the row is this turn's prompt and
    answer; the earlier answers stay masked where this prompt holds them verbatim."""
    ids, mask = (record.input_ids, record.loss_mask) if record else ([], [])
    kept = common_prefix(ids, answer.prompt_ids)
    loss_mask = mask[:kept] + [0] * (len(answer.prompt_ids) - kept) + [1] * len(answer.completion_ids)
    turn_tokens = [*(record.turn_lengths if record else []), len(answer.completion_ids)]
    return GenerationRecord(
        id=question_id,
        input_ids=answer.prompt_ids + answer.completion_ids,
        loss_mask=loss_mask,
        finish_reason=answer.finish_reason,
        completion_tokens=sum(turn_tokens),
        prompt_tokens=len(loss_mask) - sum(loss_mask),
        turns=len(turn_tokens),
        turn_completion_tokens=turn_tokens,
        turn_finish_reasons=[*(record.finish_reasons if record else []), answer.finish_reason],
        answers=[*(record.answers if record else []), answer.text],
        ended=None,
    )


class RecordWriter:
    """Appends one JSON line per finished question and fsyncs it: a crash keeps it.

    Unbuffered, and a failed write (a full disk) is cut back off: the file holds only
    whole lines, so a later append cannot glue a record onto half of another."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = path.open("ab", buffering=0)
        # The stage's appends run here, one at a time and in order: an fsync takes ~0.35 ms,
        # and on the event loop it held up every request (about 8% of the request rate).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="records")

    async def append(self, record: GenerationRecord) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self.write, record)

    def write(self, record: GenerationRecord) -> None:
        line = (record.to_json() + "\n").encode()
        end = self._handle.seek(0, os.SEEK_END)
        try:
            if self._handle.write(line) != len(line):
                raise OSError(errno.ENOSPC, "short write", str(self._handle.name))
            os.fsync(self._handle.fileno())
        except OSError:
            self._handle.truncate(end)
            raise

    def close(self) -> None:
        self._thread.shutdown()
        self._handle.close()


def capturing(post: Poster, paths: list[str | None]) -> Poster:
    """One pass: every request asks the connector for the states of the answer too, and
    the file each response names is collected (the conversation's last is its record's)."""

    async def post_capturing(payload: dict[str, Any]) -> dict[str, Any]:
        data = await post({**payload, "kv_transfer_params": {"include_output_tokens": True}})
        paths.append((data.get("kv_transfer_params") or {}).get("hidden_states_path"))
        return data

    return post_capturing


async def answer_questions(
    stage: ServerStage[str],
    endpoint: Endpoint,
    questions: list[dict[str, Any]],
    writer: RecordWriter,
    *,
    already_done: int,
    total: int,
    spool: CaptureSpool | None = None,
    staged: dict[str, GenerationRecord] | None = None,
    meter: PromptMeter | None = None,
) -> GenerationTally:
    """Finish every conversation in ``questions``, continuing those ``staged`` from their
    next turn. ``meter`` measures each later turn's prompt (None: later turns are asked
    unmeasured, for single-turn questions)."""
    generation = stage.settings.generation
    by_id = {question["id"]: question for question in questions}
    records = dict(staged or {})
    progress = Progress("generation", total, already_done=already_done)
    async with open_session(endpoint, stage.policy.concurrency, stage.policy.timeout_s) as session:
        post = chat_poster(session, endpoint)

        async def answer(question_id: str) -> dict[str, int]:
            parts = turn_requests(by_id[question_id]["messages"])
            counts = {"turns": 0, "truncated": 0}
            while not finished(record := records.get(question_id)):
                files: list[str | None] = []
                messages = turn_messages(parts, record.answers if record else [])
                payload = {
                    **generation.sampling,
                    "model": endpoint.model,
                    "messages": messages,
                    "max_tokens": generation.max_tokens,
                    "return_token_ids": True,  # prompt_token_ids + the answer's token_ids
                }
                data = await (post if spool is None else capturing(post, files))(payload)
                answer = Answer.from_response(data)
                record = with_answer(question_id, record, answer)
                if record.turns == len(parts):
                    record.ended = LAST_TURN
                elif not next_turn_fits(stage.settings, meter, parts, record.answers):
                    record.ended = CONTEXT_FULL
                if spool is not None:  # before the record: a file without one is dropped on resume
                    if record.ended is None:  # an earlier turn: the last one's states cover it
                        for path in filter(None, files):
                            discard_states(path)
                    else:
                        await spool.keep(question_id, files[-1] if files else None, record.input_ids[:-1])
                await writer.append(record)
                records[question_id] = record
                counts["turns"] += 1
                counts["truncated"] += answer.finish_reason == "length"
            return counts

        failures = await stage.request_all(list(by_id), answer, progress)
    return GenerationTally(len(by_id) - len(failures), progress.counts.get("truncated", 0), failures)


VERBATIM_SHARE = 0.9  # below this share of answer tokens trained, the template rewrites the history


def warn_if_history_rewritten(summary: dict[str, Any]) -> None:
    """Say so when the rows train much less than was generated: earlier answers come back
    in later prompts as other tokens (a template that drops their reasoning, say)."""
    generated, trained = summary["answer_tokens"], summary["answer_tokens_trained"]
    if generated and trained < VERBATIM_SHARE * generated:
        log(
            f"only {trained:,} of the {generated:,} tokens the target generated are trained: the chat template "
            "rewrites earlier answers in later prompts, so those turns are paid for but not learned; "
            "questions.turns: first avoids the cost"
        )


def external_endpoint(settings: RunConfig) -> Endpoint | None:
    external = settings.generation.endpoint
    if external is None:
        return None
    api_key = os.environ.get(external.api_key_env or "DRAFTSMITH_ENDPOINT_API_KEY", "EMPTY")
    return Endpoint(external.base_url, api_key, external.model or settings.target.model)


def publish(
    questions: list[dict[str, Any]], records: dict[str, GenerationRecord], output: Path, captures: Path | None = None
) -> None:
    """The shard's finished conversations in question order, written whole under the output
    name. One pass: each says whether its states are staged in ``captures`` (the generation
    staging)."""
    lines = []
    for question in questions:
        record = records.get(question["id"])
        if record is not None and record.finished:
            if captures is not None:
                record = dataclasses.replace(record, captured=captured_state_file(captures, question["id"]).is_file())
            lines.append(record.to_json(published=True) + "\n")
    atomic_write_text(output, "".join(lines))


def prompt_meter(settings: RunConfig, todo: list[dict[str, Any]]) -> PromptMeter | None:
    """The target's tokenizer, when there is a prompt to measure: first prompts on our own
    server (``overlong_prompts``), later turns anywhere. A finished shard loads none."""
    later_turns = any(user_turns(q["messages"]) > 1 for q in todo)
    if not todo or (settings.generation.endpoint is not None and not later_turns):
        return None
    return PromptMeter(settings.target.model, settings.target.trust_remote_code)


def reopen_if_they_fit(
    settings: RunConfig, meter: PromptMeter | None, ended: list[dict[str, Any]], staged: dict[str, GenerationRecord]
) -> None:
    """Conversations the context ended whose next turn fits the limit now (it was raised):
    asked from that turn on, their finished turns kept."""
    if meter is None or not ended:
        return
    reopened = 0
    for question in ended:
        record = staged[question["id"]]
        if next_turn_fits(settings, meter, turn_requests(question["messages"]), record.answers):
            staged[question["id"]] = dataclasses.replace(record, ended=None)
            reopened += 1
    if reopened:
        log(f"{reopened} conversations the context had ended have room for their next turn now: continued")


def overlong_prompts(settings: RunConfig, meter: PromptMeter | None, questions: list[dict[str, Any]]) -> dict[str, int]:
    """Prompt lengths of the questions whose first prompt alone fills server.max_model_len.

    vLLM would refuse each with HTTP 400, but only after the model has loaded (an hour
    for a large target); the tokenizer tells the same in seconds. An external endpoint's
    context is not ours to know, so it is not checked."""
    if meter is None or settings.generation.endpoint is not None:
        return {}
    lengths = {question["id"]: meter.tokens(first_prompt(question["messages"])) for question in questions}
    return {question: n for question, n in lengths.items() if n >= settings.server.max_model_len}


def capture_spool(settings: RunConfig, staging: Path, answered: dict[str, Any]) -> tuple[CaptureSpool, list[str]]:
    """One pass: the spool for this shard's states and the flags that make the generation
    server an extraction server too (the extraction stage's own)."""
    if settings.generation.endpoint is not None:
        raise GenerationError(
            "hidden_states.capture: during_generation needs the workflow's own generation server; "
            "remove generation.endpoint or set capture: separate"
        )
    plan, shape = target_shape(settings)
    storage = staging / VLLM_STORAGE_DIR  # made when the server starts, removed when it stops
    shutil.rmtree(storage, ignore_errors=True)  # leftovers of a killed server
    spool = CaptureSpool(staging, settings.capture_share, shape.check)
    spool.resume(answered)
    return spool, extraction_server_args(plan, storage, shape)


def run(
    settings: RunConfig, questions_path: Path, staging: Path, output: Path, granted_gpus: int | None
) -> GenerationTally:
    stage = generation_stage(settings)
    stage.begin(granted_gpus, staging)
    questions = read_questions(questions_path)
    records_path = staging / RECORDS
    staged = load_records(records_path)  # each conversation's latest turn
    adopt_from_other_shards(staging, questions, staged)
    ended_by_context = [q for q in questions if (r := staged.get(q["id"])) is not None and r.ended == CONTEXT_FULL]
    meter = prompt_meter(settings, [q for q in questions if not finished(staged.get(q["id"]))] + ended_by_context)
    reopen_if_they_fit(settings, meter, ended_by_context, staged)
    done = {question: record for question, record in staged.items() if finished(record)}
    todo = [q for q in questions if q["id"] not in done]
    continued = sum(q["id"] in staged for q in todo)
    log(
        f"{len(questions)} questions in shard: {len(done)} already answered, {len(todo)} to ask "
        f"({continued} of them from their next turn)"
    )

    overlong = overlong_prompts(settings, meter, [q for q in todo if q["id"] not in staged])
    if overlong:
        limit = settings.server.max_model_len
        message = (
            f"{len(overlong)} of {len(questions)} questions have a prompt that fills "
            f"server.max_model_len={limit} on its own (longest {max(overlong.values())} tokens, "
            f"e.g. {next(iter(overlong))})"
        )
        if not stage.policy.allows(len(overlong), len(questions)):
            raise GenerationError(f"{message}: raise server.max_model_len or drop them; nothing was started")
        log(f"{message}: skipped, counted as failed")
        todo = [q for q in todo if q["id"] not in overlong]

    tally = GenerationTally(errors={i: f"prompt of {n} tokens fills max_model_len" for i, n in overlong.items()})
    one_pass = settings.hidden_states.during_generation
    spool, server_args = capture_spool(settings, staging, done) if one_pass else (None, [])
    if todo:
        writer = RecordWriter(records_path)
        started = time.monotonic()
        if one_pass:
            (staging / VLLM_STORAGE_DIR).mkdir()
        try:
            spec = ServerSpec.from_config(settings, extra_args=server_args)
            with stage.server(spec, SPECULATORS_CLIENT, external=external_endpoint(settings)) as endpoint:
                asked = asyncio.run(
                    answer_questions(
                        stage,
                        endpoint,
                        todo,
                        writer,
                        already_done=len(done),
                        total=len(questions),
                        spool=spool,
                        staged=staged,
                        meter=meter,
                    )
                )
            tally = GenerationTally(asked.ok, asked.truncated, tally.errors | asked.errors)
        finally:
            writer.close()
            if one_pass:  # files of requests that failed or were cut off
                shutil.rmtree(staging / VLLM_STORAGE_DIR, ignore_errors=True)
        log(
            f"asked {len(todo)} in {time.monotonic() - started:.0f}s: "
            f"{tally.ok} ok ({tally.truncated} truncated at max_tokens), {len(tally.errors)} failed"
        )

    records = load_records(records_path)
    missing = [q["id"] for q in questions if not finished(records.get(q["id"]))]
    answered = [records[q["id"]] for q in questions if q["id"] not in missing]
    summary = {
        "questions": len(questions),
        "answered": len(answered),
        "turns_answered": sum(r.turns for r in answered),
        # Conversations that stopped before their last user turn: its prompt would not fit.
        "ended_by_context": sum(r.ended == CONTEXT_FULL for r in answered),
        "truncated": sum(r.finish_reasons.count("length") for r in answered),  # turns cut at max_tokens
        # Generated tokens, and those the rows train: fewer where a later turn's prompt does
        # not hold an earlier answer verbatim (a template that rewrites the history).
        "answer_tokens": sum(r.completion_tokens for r in answered),
        "answer_tokens_trained": sum(sum(r.loss_mask) for r in answered),
        "failed": len(missing),
        "asked_this_run": len(todo),
        "errors": dict(list(tally.errors.items())[:20]),
    }
    if spool is not None:
        summary["states_captured"] = {"answers": spool.kept, "bytes": spool.bytes, "not_kept": dict(spool.skipped)}
    atomic_write_text(staging / SUMMARY, json.dumps(summary, indent=2) + "\n")
    warn_if_history_rewritten(summary)
    stage.check_failures(
        {i: tally.errors.get(i, "not answered") for i in missing},
        len(questions),
        kept=f"Answered ones are kept in {records_path} and a rerun asks only for the rest",
    )
    publish(questions, records, output, staging if one_pass else None)
    log(f"published {summary['answered']} answers to {output}")
    return tally


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(__doc__)
    parser.add_argument("--questions", required=True, type=Path)
    parser.add_argument("--staging", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--granted-gpus", type=int, default=None, help="what Snakemake granted")
    args = parser.parse_args(argv)
    run(read_settings(args.settings, "generate"), args.questions, args.staging, args.output, args.granted_gpus)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
