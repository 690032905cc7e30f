"""Tests of the demo target: synthetic language, tokenizer, chat template, model, question file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from draftsmith import demo_language as lang
from draftsmith import demo_model as dm

QUESTIONS = Path(__file__).resolve().parents[1] / "config" / "demo_questions.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return lang.build_tokenizer()


def token_id(tokenizer, token: str) -> int:
    return tokenizer.convert_tokens_to_ids(token)


def test_vocabulary_is_small_and_unique():
    vocab = lang.vocabulary()
    assert len(vocab) == len(set(vocab))
    assert 200 <= len(vocab) <= 300
    assert vocab[0] == lang.UNK


def test_tokenizer_round_trips_words(tokenizer):
    text = "count from 3 to 9 <think> start at 3 </think> 3 4 5"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert lang.UNK not in tokenizer.convert_ids_to_tokens(ids)
    assert len(ids) == len(text.split())
    assert tokenizer.decode(ids) == text


def test_unknown_words_map_to_unk(tokenizer):
    ids = tokenizer("count zzzz", add_special_tokens=False)["input_ids"]
    assert ids[1] == tokenizer.unk_token_id


def test_think_tags_survive_skip_special_tokens(tokenizer):
    # vLLM's default skip_special_tokens must not strip the reasoning wrapper from text.
    ids = tokenizer("<think> a </think> b </s>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think> a </think> b"


def test_special_token_ids_are_fixed(tokenizer):
    expected = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "<pad>": 3,
        "<|system|>": 4,
        "<|user|>": 5,
        "<|assistant|>": 6,
        "<think>": 7,
        "</think>": 8,
    }
    assert {t: token_id(tokenizer, t) for t in expected} == expected
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 3)


def test_generation_prompt_leaves_think_to_the_model(tokenizer):
    example = lang.make_example(random.Random(1), "count_up")
    messages = lang.example_messages(example)
    prompt = lang.render(tokenizer, messages[:-1], add_generation_prompt=True)
    full = lang.render(tokenizer, messages)
    think, end_think = token_id(tokenizer, "<think>"), token_id(tokenizer, "</think>")
    assert prompt[-1] == token_id(tokenizer, "<|assistant|>")
    assert think not in prompt and end_think not in prompt
    assert full[: len(prompt)] == prompt
    generated = full[len(prompt) :]
    assert generated[0] == think and end_think in generated
    assert generated[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "inline"])
def test_template_keeps_reasoning_wrapper(tokenizer, field):
    user = {"role": "user", "content": "spell cat"}
    if field == "inline":
        assistant = {"role": "assistant", "content": "<think> the word cat has 3 letters </think> c a t"}
    else:
        assistant = {"role": "assistant", "content": "c a t", field: "the word cat has 3 letters"}
    text = tokenizer.apply_chat_template([user, assistant], tokenize=False)
    assert "<|assistant|> <think> the word cat has 3 letters </think> c a t </s>" in text
    assert text.count("<think>") == 1


def test_template_renders_system_turn(tokenizer):
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "spell cat"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|> answer briefly <|user|> spell cat <|assistant|>"


@pytest.mark.parametrize("task", lang.TASKS)
def test_examples_are_deterministic_and_in_vocabulary(task):
    first = [lang.make_example(random.Random(5), task) for _ in range(3)]
    again = [lang.make_example(random.Random(5), task) for _ in range(3)]
    assert first == again
    vocab = set(lang.vocabulary())
    for example in first:
        words = f"{example.question} {example.assistant_content}".split()
        assert set(words) <= vocab, set(words) - vocab


def test_answers_follow_the_question():
    rng = random.Random(3)
    for _ in range(50):
        example = lang.make_example(rng)
        q, a = example.question.split(), example.answer.split()
        if example.task == "count_up":
            assert a == [str(i) for i in range(int(q[-3]), int(q[-1]) + 1)]
        elif example.task == "count_down":
            assert a == [str(i) for i in range(int(q[-3]), int(q[-1]) - 1, -1)]
        elif example.task == "spell":
            word = q[1] if q[0] == "write" else q[-1]
            assert "".join(a) == word
        elif example.task == "repeat":
            times, phrase = int(q[-2]), q[1:-2]
            assert a == phrase * times
        elif example.task == "count_by":
            low, high, step = int(q[-5]), int(q[-3]), int(q[-1])
            assert a == [str(i) for i in range(low, high + 1, step)]
        else:
            raise AssertionError(f"untested task {example.task}")


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown task"):
        lang.make_example(random.Random(0), "sort")


def test_model_config_has_head_dim_64(tokenizer):
    config = dm.model_config(tokenizer)
    assert config.head_dim == 64 and config.hidden_size // config.num_attention_heads == 64
    assert config.vocab_size == len(tokenizer)
    assert config.num_hidden_layers == 6 and not config.tie_word_embeddings
    assert config.eos_token_id == tokenizer.eos_token_id


def test_batch_masks_the_prompt(tokenizer):
    batch = dm.make_batch(tokenizer, random.Random(0), 4)
    assistant = token_id(tokenizer, "<|assistant|>")
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True):
        start = (ids == assistant).nonzero()[-1].item() + 1
        assert (labels[:start] == -100).all()
        assert labels[start].item() == token_id(tokenizer, "<think>")
        assert (labels[mask == 0] == -100).all()
        assert labels[mask.sum() - 1].item() == tokenizer.eos_token_id


def test_question_file_is_shipped_and_current():
    lines = QUESTIONS.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) >= 300
    assert rows == lang.question_rows()  # regenerate with `python -m draftsmith.demo_model questions`
    assert len(set(lines)) >= 300 and len(set(lines)) < len(lines)  # has exact duplicates
    shapes = {next(k for k in ("messages", "conversations", "prompt") if k in row) for row in rows}
    assert shapes == {"messages", "conversations", "prompt"}
    vocab = set(lang.vocabulary())
    for row in rows:
        if "messages" in row:
            text = " ".join(m["content"] for m in row["messages"])
        elif "conversations" in row:
            text = " ".join(m["value"] for m in row["conversations"])
        else:
            text = row["prompt"]
        assert set(text.split()) <= vocab, row


def test_question_rows_are_deterministic():
    assert lang.question_rows(40, seed=1) == lang.question_rows(40, seed=1)
    assert lang.question_rows(40, seed=1) != lang.question_rows(40, seed=2)


def test_build_writes_a_loadable_model(tmp_path):
    out = tmp_path / "model"
    stats = dm.build_demo_model(out, train_seconds=0, max_steps=3, seed=0, eval_per_task=0)
    assert stats.steps == 3
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= {p.name for p in out.iterdir()}
    config = AutoConfig.from_pretrained(out)
    assert config.head_dim == 64 and config.eos_token_id == 2
    assert str(config.dtype).endswith("bfloat16")
    loaded = AutoTokenizer.from_pretrained(out)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    messages = [{"role": "user", "content": "spell cat"}]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True).endswith("<|assistant|>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging left behind
    assert out.stat().st_mode & 0o755 == 0o755


def test_failed_build_leaves_no_partial_output(tmp_path, monkeypatch):
    out = tmp_path / "model"
    out.mkdir()
    (out / "marker").write_text("previous model")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", boom)
    with pytest.raises(OSError, match="disk full"):
        dm.build_demo_model(out, train_seconds=0, max_steps=1, seed=0, eval_per_task=0)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert (out / "marker").read_text() == "previous model"


def test_cli_defaults_to_build():
    args = dm.parse_args(["--output", "x", "--seed", "2"])
    assert args.command == "build" and args.train_seconds == 60 and args.seed == 2
    args = dm.parse_args(["questions", "--output", "q.jsonl"])
    assert args.command == "questions" and args.count == 1200
