"""Generation stage: the target answers one shard of questions, resumably.

The request/response logic is speculators' own (`regenerate_conversation`: chat
completion with ``return_token_ids``, prompt tokens masked 0, generated tokens 1),
used as a library. We do not shell out to `speculators regenerate-responses`
because it cannot send an API key (its session has fixed headers) and our
servers require one; and because resume, the error budget and atomic publishing
must follow this workflow's rules:

- every finished answer is appended (and fsynced) to ``<staging>/records.jsonl``,
  outside the declared output, so a crash loses only in-flight requests;
- a rerun skips the ids already there and asks only for the rest;
- the shard is published to its output in one rename once all its questions are
  answered, or the stage fails when more than ``max_error_fraction`` failed.

The order of the work, the retries and the error budget are those of every server
stage (``server_stage``); what is this stage's own is below.

In one pass (``hidden_states.capture: during_generation``) the server is an extraction
server too, and each answer's hidden states are staged with it (``one_pass.CaptureSpool``).

The token ids are the model's own: reasoning stays wrapped in its think tags
exactly as generated (the hand-run scripts lost that wrapper).
"""

from __future__ import annotations

import argparse
import asyncio
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
from draftsmith.cli import SETTINGS_HELP, read_settings
from draftsmith.client import SPECULATORS_CLIENT, Poster, chat_poster, open_session
from draftsmith.layout import GENERATION_RECORDS, SUMMARY
from draftsmith.one_pass import CaptureSpool, captured_state_file, discard_states
from draftsmith.progress import Progress, log
from draftsmith.prompt_length import PromptMeter
from draftsmith.run_config import RunConfig
from draftsmith.server import Endpoint, ServerSpec
from draftsmith.server_stage import RequestPolicy, ServerStage, StageError
from draftsmith.staging import matching_siblings

RECORDS = GENERATION_RECORDS
SPECULATORS_GENERATION = "speculators.cli.regenerate_responses"  # imported while the server loads
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [("speculators.cli.regenerate_responses", "regenerate_conversation")]


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


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """Finished answers by question id, leaving the file as it is (a torn last line is skipped)."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    return {record["id"]: record for record in map(json.loads, complete.decode("utf-8").splitlines())}


def load_records(path: Path) -> dict[str, dict[str, Any]]:
    """This shard's finished answers. A torn last line (crash mid-write) is cut off, so
    later appends start on a clean line."""
    if path.exists():
        size, complete = path.stat().st_size, path.read_bytes().rfind(b"\n") + 1
        if complete != size:
            log(f"dropping a torn last line from {path} (interrupted write)")
            with path.open("r+b") as handle:
                handle.truncate(complete)
    return read_records(path)


def adopt_from_other_shards(staging: Path, questions: list[dict[str, Any]], done: dict[str, Any]) -> None:
    """After a re-sharding, answers to this shard's questions may sit in another shard's
    staging (made under the same settings): copy them here, and into ``done``, instead of
    asking again."""
    wanted = {q["id"] for q in questions} - done.keys()
    adopted = {}
    for sibling in matching_siblings(staging) if wanted else []:
        for question_id, record in read_records(sibling / RECORDS).items():
            if question_id in wanted:
                adopted[question_id] = record
                wanted.discard(question_id)
    if adopted:
        writer = RecordWriter(staging / RECORDS)
        try:
            for record in adopted.values():
                writer.write(record)
        finally:
            writer.close()
        done.update(adopted)
        log(f"reused {len(adopted)} answers staged by other shards under the same settings")


def record_from_sample(question_id: str, sample: dict[str, Any]) -> dict[str, Any]:
    finish_reason = sample["metadata"].get("finish_reason")
    return {
        "id": question_id,
        "input_ids": sample["input_ids"],
        "loss_mask": sample["loss_mask"],
        "finish_reason": finish_reason,
        "completion_tokens": sum(sample["loss_mask"]),
        "prompt_tokens": len(sample["loss_mask"]) - sum(sample["loss_mask"]),
    }


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

    async def append(self, record: dict[str, Any]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self.write, record)

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode()
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
    the file each response names is collected (the conversation's first is its record's)."""

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
) -> GenerationTally:
    from speculators.cli.regenerate_responses import regenerate_conversation

    generation = stage.settings.generation
    by_id = {question["id"]: question for question in questions}
    position = {question_id: index for index, question_id in enumerate(by_id)}
    progress = Progress("generation", total, already_done=already_done)
    async with open_session(endpoint, stage.policy.concurrency, stage.policy.timeout_s) as session:
        post = chat_poster(session, endpoint)

        async def answer(question_id: str) -> dict[str, int]:
            item = {"idx": position[question_id], "primary_id": question_id, "turns": by_id[question_id]["messages"]}
            samples: list[dict[str, Any]] = []
            files: list[str | None] = []
            await regenerate_conversation(
                post if spool is None else capturing(post, files),
                item,
                model=endpoint.model,
                max_tokens=generation.max_tokens,
                endpoint=endpoint.base_url,
                sampling_params=generation.sampling,
                samples=samples,
                detokenize=lambda ids: "",  # review-only text twin; not needed
            )
            record = record_from_sample(question_id, samples[0])
            if spool is not None:  # before the record: a file without one is dropped on resume
                for later in filter(None, files[1:]):  # later turns of a conversation: not trained
                    discard_states(later)
                await spool.keep(question_id, files[0] if files else None, record["input_ids"][:-1])
            await writer.append(record)
            return {"truncated": int(record["finish_reason"] == "length")}

        failures = await stage.request_all(list(by_id), answer, progress)
    return GenerationTally(len(by_id) - len(failures), progress.counts.get("truncated", 0), failures)


def external_endpoint(settings: RunConfig) -> Endpoint | None:
    external = settings.generation.endpoint
    if external is None:
        return None
    api_key = os.environ.get(external.api_key_env or "DRAFTSMITH_ENDPOINT_API_KEY", "EMPTY")
    return Endpoint(external.base_url, api_key, external.model or settings.target.model)


def publish(
    questions: list[dict[str, Any]], records: dict[str, dict[str, Any]], output: Path, captures: Path | None = None
) -> None:
    """The shard's answers in question order, written whole under the output name. One
    pass: each says whether its states are staged in ``captures`` (the generation staging)."""
    lines = []
    for question in questions:
        record = records.get(question["id"])
        if record is not None:
            if captures is not None:
                record = {**record, "captured": captured_state_file(captures, question["id"]).is_file()}
            lines.append(json.dumps(record) + "\n")
    atomic_write_text(output, "".join(lines))


def overlong_prompts(settings: RunConfig, questions: list[dict[str, Any]]) -> dict[str, int]:
    """Prompt lengths of the questions whose prompt alone fills server.max_model_len.

    vLLM would refuse each with HTTP 400, but only after the model has loaded (an hour
    for a large target); the tokenizer tells the same in seconds. An external endpoint's
    context is not ours to know, so it is not checked."""
    if not questions or settings.generation.endpoint is not None:
        return {}  # nothing to ask (a finished shard loads no tokenizer), or nothing to check
    meter = PromptMeter(settings.target.model, settings.target.trust_remote_code)
    lengths = {question["id"]: meter.tokens(question["messages"]) for question in questions}
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
    done = load_records(records_path)
    adopt_from_other_shards(staging, questions, done)
    todo = [q for q in questions if q["id"] not in done]
    log(f"{len(questions)} questions in shard: {len(done)} already answered, {len(todo)} to ask")

    overlong = overlong_prompts(settings, todo)
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
            imports = (SPECULATORS_GENERATION, SPECULATORS_CLIENT)
            with stage.server(spec, *imports, external=external_endpoint(settings)) as endpoint:
                asked = asyncio.run(
                    answer_questions(
                        stage, endpoint, todo, writer, already_done=len(done), total=len(questions), spool=spool
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
    missing = [q["id"] for q in questions if q["id"] not in records]
    summary = {
        "questions": len(questions),
        "answered": len(questions) - len(missing),
        "truncated": sum(r["finish_reason"] == "length" for r in records.values()),
        "failed": len(missing),
        "asked_this_run": len(todo),
        "errors": dict(list(tally.errors.items())[:20]),
    }
    if spool is not None:
        summary["states_captured"] = {"answers": spool.kept, "bytes": spool.bytes, "not_kept": dict(spool.skipped)}
    atomic_write_text(staging / SUMMARY, json.dumps(summary, indent=2) + "\n")
    stage.check_failures(
        {i: tally.errors.get(i, "not answered") for i in missing},
        len(questions),
        kept=f"Answered ones are kept in {records_path} and a rerun asks only for the rest",
    )
    publish(questions, records, output, staging if one_pass else None)
    log(f"published {summary['answered']} answers to {output}")
    return tally


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, help=SETTINGS_HELP)
    parser.add_argument("--questions", required=True, type=Path)
    parser.add_argument("--staging", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--granted-gpus", type=int, default=None, help="what Snakemake granted")
    args = parser.parse_args(argv)
    run(read_settings(args.settings, "generate"), args.questions, args.staging, args.output, args.granted_gpus)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
