"""Generation stage against the real vLLM CPU build: think tags, masks, resume, error budget."""

import json
import time

import pytest
from conftest import server_settings
from transformers import AutoTokenizer

from draftsmith import generate
from draftsmith.demo_language import question_rows
from draftsmith.errors import DraftsmithError
from draftsmith.run_config import RunConfig
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
    records.write_text('{"id": "a", "input_ids": [1], "loss_mask": [1]}\n{"id": "b", "inp')
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
    (staging / generate.RECORDS).write_text('{"id": "a", "input_ids": [1], "loss_mask": [1]}\n')

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
