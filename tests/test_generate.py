"""Generation stage against the real vLLM CPU build: think tags, masks, resume, error budget,
and multi-turn conversations (each answer the target's own, resumed between turns)."""

import json
import time

import pytest
from conftest import generation_line, server_settings
from datasets import load_from_disk
from transformers import AutoTokenizer

from draftsmith import client, dataset, generate
from draftsmith.demo_language import question_rows
from draftsmith.errors import DraftsmithError
from draftsmith.records import CONTEXT_FULL, GenerationRecord, RowIds
from draftsmith.run_config import RunConfig
from draftsmith.server import ServerSpec, managed_server
from draftsmith.settings import item_settings
from draftsmith.staging import open_staging

GENERATION = {
    "concurrency": 4,
    "max_tokens": 48,
    "sampling": {"temperature": 0.0},
    "max_error_fraction": 0.0,
    "request_timeout_s": 120,
    "max_retries": 1,
    "endpoint": None,
}


def write_questions(path, count, seed=1):
    rows = [r for r in question_rows(count + 10, seed=seed, duplicates=0) if "messages" in r][:count]
    path.write_text("".join(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n" for r in rows))
    return rows


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_complete_and_well_formed(output, questions):
    records = read_jsonl(output)
    assert [r["id"] for r in records] == [q["id"] for q in questions]  # each once, in order
    for record in records:
        mask = record["loss_mask"]
        assert len(mask) == len(record["input_ids"]) and record["completion_tokens"] > 0
        assert mask == [0] * record["prompt_tokens"] + [1] * record["completion_tokens"]


def long_question(words: int) -> dict:
    return {"id": "q-long", "messages": [{"role": "user", "content": " ".join(["count"] * words)}]}


@pytest.fixture(scope="module")
def generated(demo_target, tmp_path_factory):
    """One real generation run (a server load costs CI about 40 s): six questions, then one
    whose prompt fills the context, within a 20% error budget. Returns (questions answered,
    work directory)."""
    work = tmp_path_factory.mktemp("generated")
    questions = write_questions(work / "q.jsonl", 6)
    with (work / "q.jsonl").open("a") as handle:
        handle.write(json.dumps(long_question(600)) + "\n")
    settings = server_settings(demo_target) | {"generation": GENERATION | {"max_error_fraction": 0.2}}
    generate.run(RunConfig.from_dict(settings), work / "q.jsonl", work / "staging", work / "out.jsonl", None)
    return questions, work


@pytest.mark.vllm
def test_answers_keep_think_tags_and_mask_only_the_answer(demo_target, generated):
    questions, work = generated
    tokenizer = AutoTokenizer.from_pretrained(demo_target)
    think_open, think_close = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    records = read_jsonl(work / "out.jsonl")
    assert [r["id"] for r in records] == [q["id"] for q in questions]
    for record, question in zip(records, questions, strict=True):
        ids, mask = record["input_ids"], record["loss_mask"]
        prompt = list(
            tokenizer.apply_chat_template(
                question["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        n_prompt = len(prompt)
        # The mask covers exactly the generated tokens, nothing of the prompt.
        assert ids[:n_prompt] == prompt
        assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
        # The reasoning wrapper is in the trained tokens, as the model produced it.
        answer = ids[n_prompt:]
        assert answer[0] == think_open and think_close in answer
        text = tokenizer.decode(answer, skip_special_tokens=False)
        assert text.startswith("<think>") and "</think>" in text


@pytest.mark.vllm
def test_an_overlong_prompt_within_the_error_budget_is_skipped_and_counted(generated):
    questions, work = generated
    assert_complete_and_well_formed(work / "out.jsonl", questions)
    summary = json.loads((work / "staging" / "summary.json").read_text())
    assert summary["failed"] == 1 and summary["asked_this_run"] == 6
    assert summary["errors"]["q-long"].startswith("prompt of ") and "fills max_model_len" in summary["errors"]["q-long"]


def test_failures_over_the_budget_fail_the_stage_and_publish_nothing(tmp_path):
    write_questions(tmp_path / "q.jsonl", 3)
    dead = {"base_url": "http://127.0.0.1:9/v1", "model": "nothing"}
    settings = server_settings(tmp_path) | {
        "generation": GENERATION | {"endpoint": dead, "max_retries": 0, "max_error_fraction": 0.5}
    }
    with pytest.raises(generate.GenerationError, match="3 of 3 questions failed"):
        generate.run(
            RunConfig.from_dict(settings), tmp_path / "q.jsonl", tmp_path / "staging", tmp_path / "out.jsonl", None
        )
    assert not (tmp_path / "out.jsonl").exists()


def test_a_torn_last_record_is_cut_off(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text(generation_line("a") + '{"id": "b", "inp')
    assert list(generate.load_records(records)) == ["a"]
    assert records.read_text().endswith("}\n")


def test_gpu_slot_smaller_than_tp_is_refused_before_any_work(tmp_path):
    settings = server_settings(tmp_path, tensor_parallel_size=8) | {"device": "cuda", "gpu_slot": 8}
    settings["generation"] = GENERATION
    with pytest.raises(DraftsmithError, match="granted 4 GPU.*--resources gpu=8"):
        generate.run(
            RunConfig.from_dict(settings), tmp_path / "absent.jsonl", tmp_path / "s", tmp_path / "o", granted_gpus=4
        )


def test_staged_answers_are_dropped_when_a_generation_setting_changes(tmp_path):
    staging = tmp_path / "staging"
    settings = server_settings(tmp_path) | {"generation": GENERATION}
    generate.generation_stage(RunConfig.from_dict(settings)).begin(None, staging)
    (staging / generate.RECORDS).write_text(generation_line("a"))

    same = settings | {"generation": GENERATION | {"concurrency": 99, "max_retries": 7}}
    generate.generation_stage(RunConfig.from_dict(same)).begin(None, staging)
    assert list(generate.load_records(staging / generate.RECORDS)) == ["a"]

    changed = settings | {"generation": GENERATION | {"max_tokens": 12}}
    generate.generation_stage(RunConfig.from_dict(changed)).begin(None, staging)
    assert generate.load_records(staging / generate.RECORDS) == {}


def test_resharded_questions_take_their_answers_from_the_old_shards(tmp_path, capfd):
    """After questions.shards changes, a shard's questions were answered under another
    shard's staging: those made under the same settings are reused, not asked again (no
    server starts here: none could, the model does not exist)."""
    questions = write_questions(tmp_path / "q.jsonl", 4)
    settings = server_settings(tmp_path / "no-model") | {"generation": GENERATION}
    changed = settings | {"generation": GENERATION | {"max_tokens": 12}}
    for shard, made_with, token in ((1, settings, 7), (2, changed, 9)):
        staging = open_staging(tmp_path / "staging" / f"shard_{shard}", item_settings(made_with, "generate"))
        (staging / generate.RECORDS).write_text(
            "".join(
                json.dumps(
                    {
                        "id": q["id"],
                        "input_ids": [1, token, token],
                        "loss_mask": [0, 1, 1],
                        "finish_reason": "stop",
                        "completion_tokens": 2,
                        "prompt_tokens": 1,
                    }
                )
                + "\n"
                for q in questions
            )
        )
    generate.run(
        RunConfig.from_dict(settings),
        tmp_path / "q.jsonl",
        tmp_path / "staging" / "shard_0",
        tmp_path / "out.jsonl",
        None,
    )
    assert "reused 4 conversations staged by other shards" in capfd.readouterr().err
    published = read_jsonl(tmp_path / "out.jsonl")
    assert [r["id"] for r in published] == [q["id"] for q in questions]
    assert all(r["input_ids"] == [1, 7, 7] for r in published)  # not the other settings' answers


def test_prompts_that_fill_the_context_fail_before_the_server_starts(demo_target, tmp_path):
    write_questions(tmp_path / "q.jsonl", 3)
    with (tmp_path / "q.jsonl").open("a") as handle:
        handle.write(json.dumps(long_question(600)) + "\n")
    settings = server_settings(demo_target) | {"generation": GENERATION}
    started = time.monotonic()
    with pytest.raises(generate.GenerationError) as caught:
        generate.run(
            RunConfig.from_dict(settings), tmp_path / "q.jsonl", tmp_path / "staging", tmp_path / "out.jsonl", None
        )
    assert str(caught.value).startswith(
        "1 of 4 questions have a prompt that fills server.max_model_len=512 on its own (longest "
    )
    assert "e.g. q-long): raise server.max_model_len or drop them; nothing was started" in str(caught.value)
    assert time.monotonic() - started < 10  # a tokenizer pass, no model load


# --- multi-turn conversations (questions.turns: all) ---------------------------------------

TURNS = 3


class Killed(BaseException):
    """The stage dies here, between two turns (not an Exception: no retry catches it)."""


def conversations(count: int, turns: int) -> list[dict]:
    """``count`` conversations of ``turns`` demo questions each, as the questions stage writes them."""
    rows = [r for r in question_rows(count * turns + 20, seed=2, duplicates=0) if "messages" in r]
    return [
        {"id": f"conv-{i}", "messages": [m for r in rows[i * turns : (i + 1) * turns] for m in r["messages"]]}
        for i in range(count)
    ]


def recording_poster(monkeypatch, asked: list, kill_before: tuple[str, int] | None = None) -> None:
    """Every request and its response, as (conversation, turn, payload, response); raise
    ``Killed`` instead of asking ``kill_before`` (conversation, turn)."""

    def poster(session, endpoint):
        post = client.chat_poster(session, endpoint)

        async def recorded(payload):
            first = next(m["content"] for m in payload["messages"] if m["role"] == "user")
            key = (CONVERSATION_OF[first], sum(m["role"] == "assistant" for m in payload["messages"]))
            if key == kill_before:
                raise Killed
            data = await post(payload)
            asked.append((*key, payload, data))
            return data

        return recorded

    monkeypatch.setattr(generate, "chat_poster", poster)


CONVERSATION_OF: dict[str, str] = {}


@pytest.fixture(scope="module")
def multi_turn(demo_target, tmp_path_factory):
    """Three conversations of three turns and one whose second turn would not fit, against
    one server: killed before the second turn of the second conversation, then resumed.
    Returns (questions, every request with its response, the staging at the kill, work)."""
    work = tmp_path_factory.mktemp("multi_turn")
    questions = conversations(3, TURNS)
    spell = {"role": "user", "content": "spell the word cat"}
    questions.append({"id": "conv-long", "messages": [spell, *long_question(470)["messages"]]})
    CONVERSATION_OF.update({q["messages"][0]["content"]: q["id"] for q in questions})
    (work / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    settings = server_settings(demo_target)
    asked: list = []
    with (
        pytest.MonkeyPatch.context() as patch,
        managed_server(ServerSpec.from_config(RunConfig.from_dict(settings))) as endpoint,
    ):
        patch.setenv("DRAFTSMITH_TEST_KEY", endpoint.api_key)
        external = {"base_url": endpoint.base_url, "model": endpoint.model, "api_key_env": "DRAFTSMITH_TEST_KEY"}
        generation = GENERATION | {"concurrency": 1, "max_tokens": 24, "endpoint": external}
        run_settings = RunConfig.from_dict(
            settings | {"generation": generation, "questions": {"max_prompt_tokens": None}}
        )
        recording_poster(patch, asked, kill_before=("conv-1", 1))
        with pytest.raises(BaseExceptionGroup) as killed:  # the task group's, around Killed
            generate.run(run_settings, work / "q.jsonl", work / "staging", work / "out.jsonl", None)
        assert killed.value.subgroup(Killed) is not None, killed.value
        at_kill = generate.read_records(work / "staging" / generate.RECORDS)
        resumed_from = len(asked)
        recording_poster(patch, asked)
        generate.run(run_settings, work / "q.jsonl", work / "staging", work / "out.jsonl", None)
    return questions, asked, resumed_from, at_kill, work


@pytest.mark.vllm
def test_a_kill_between_turns_resumes_without_asking_a_finished_turn_again(multi_turn):
    _, asked, resumed_from, at_kill, work = multi_turn
    assert {q: r.turns for q, r in at_kill.items()} == {"conv-0": TURNS, "conv-1": 1}
    assert generate.finished(at_kill["conv-0"]) and not generate.finished(at_kill["conv-1"])
    before = [(q, turn) for q, turn, *_ in asked[:resumed_from]]
    after = [(q, turn) for q, turn, *_ in asked[resumed_from:]]
    assert before == [("conv-0", 0), ("conv-0", 1), ("conv-0", 2), ("conv-1", 0)]
    assert after == [("conv-1", 1), ("conv-1", 2), ("conv-2", 0), ("conv-2", 1), ("conv-2", 2), ("conv-long", 0)]
    summary = json.loads((work / "staging" / "summary.json").read_text())
    assert (summary["answered"], summary["turns_answered"], summary["ended_by_context"]) == (4, 10, 1)


@pytest.mark.vllm
def test_every_answer_in_the_stored_dataset_is_the_targets_own_and_only_those_are_masked(multi_turn, demo_target):
    """Each turn's request holds the target's earlier answers (the source's are not asked
    for); the conversation's row is its last request, every turn's answer sits in it where
    the target wrote it, and the loss mask covers exactly those answers. The dataset stage
    stores the rows as they are."""
    questions, asked, _, _, work = multi_turn
    responses = {(q, turn): (payload, data) for q, turn, payload, data in asked}
    records = {r["id"]: r for r in read_jsonl(work / "out.jsonl")}
    assert list(records) == [q["id"] for q in questions]
    for question in questions:
        record = records[question["id"]]
        turns = TURNS if question["id"] != "conv-long" else 1
        assert (record["turns"], record["ended"]) == (turns, "last turn" if turns == TURNS else "context full")
        ids, covered = record["input_ids"], [0] * len(record["input_ids"])
        for turn in range(turns):
            payload, data = responses[(question["id"], turn)]
            prompt, answer = data["prompt_token_ids"], data["choices"][0]["token_ids"]
            earlier = [m["content"] for m in payload["messages"] if m["role"] == "assistant"]
            assert earlier == [
                responses[(question["id"], t)][1]["choices"][0]["message"]["content"] for t in range(turn)
            ]
            assert ids[: len(prompt)] == prompt and ids[len(prompt) : len(prompt) + len(answer)] == answer
            covered[len(prompt) : len(prompt) + len(answer)] = [1] * len(answer)
            if turn == turns - 1:
                assert ids == prompt + answer  # the whole conversation, as the target saw it last
        assert record["loss_mask"] == covered and record["completion_tokens"] == sum(covered)
        assert "answers" not in record  # the texts stay in the staging
    settings = {
        "target": {"model": str(demo_target), "trust_remote_code": False},
        "dataset": {"seq_length": 448, "min_trainable_tokens": 1},
        "hidden_states": {"capture": "separate"},
    }
    dataset.run(RunConfig.from_dict(settings), [work / "out.jsonl"], work / "dataset_staging", work / "dataset")
    rows = load_from_disk(str(work / "dataset")).with_format(None)
    for question, input_ids, loss_mask in zip(
        RowIds.read(work / "dataset").ids, rows["input_ids"], rows["loss_mask"], strict=True
    ):
        assert (input_ids, loss_mask) == (records[question]["input_ids"], records[question]["loss_mask"])


def test_a_larger_context_continues_the_conversations_the_smaller_one_ended(tiny_tokenizer):
    """A conversation ended because its next prompt would not fit is asked from that turn on
    once the limit is raised (the limit is an extent of the rule, not a shape)."""
    from draftsmith.prompt_length import PromptMeter

    question = {"id": "c", "messages": [*long_question(1)["messages"], *long_question(150)["messages"]]}
    record = GenerationRecord("c", [1, 2], [0, 1], "stop", 1, 1, answers=["1 2 3"], ended=CONTEXT_FULL)
    staged = {"c": record}
    meter = PromptMeter(str(tiny_tokenizer))
    for context, reopened in ((128, False), (512, True)):
        limits = {"server": {"max_model_len": context}, "generation": {"max_tokens": 24}}
        settings = RunConfig.from_dict(limits | {"questions": {"max_prompt_tokens": None}})
        generate.reopen_if_they_fit(settings, meter, [question], staged)
        assert generate.finished(staged["c"]) != reopened


def test_records_from_before_conversations_read_as_one_finished_turn():
    """Staged and published answers of runs made before multi-turn conversations hold no turn
    fields: they read as what they are, one finished turn, and publish with the same fields."""
    old = {"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "finish_reason": "length"}
    record = GenerationRecord.from_json(json.dumps(old | {"completion_tokens": 2, "prompt_tokens": 1}))
    assert record.finished and record.turns == 1 and record.answers == []
    assert record.turn_lengths == [2] and record.finish_reasons == ["length"]
    published = json.loads(record.to_json(published=True))
    assert "answers" not in published and "captured" not in published and published["input_ids"] == [1, 2, 3]
