"""Questions stage: shapes, dedup, stable ids, deterministic split, bad rows."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftsmith import question_sources as qs
from draftsmith import questions as q
from draftsmith.run_config import ALL, FIRST, RunConfig


def settings(source, model, max_model_len=512, max_tokens=64, **overrides):
    section = {
        "source": str(source),
        "split": "train",
        "subset": None,
        "limit": None,
        "heldout": 2,
        "shards": 2,
        "seed": 0,
        "max_prompt_tokens": None,
        "turns": "first",
    }
    section.update(overrides)
    return RunConfig.from_dict(
        {
            "questions": section,
            "target": {"model": str(model), "trust_remote_code": False},
            "server": {"max_model_len": max_model_len},
            "generation": {"max_tokens": max_tokens},
        }
    )


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def all_ids(out):
    ids = [r["id"] for i in range(2) for r in read_jsonl(out / f"shard_{i}.jsonl")]
    return ids + [r["id"] for r in read_jsonl(out / "heldout.jsonl")]


ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "count to 3"},
            {"role": "assistant", "content": "1 2 3"},
            {"role": "user", "content": "again"},
        ]
    },
    {"conversations": [{"from": "human", "value": "spell cat"}, {"from": "gpt", "value": "c a t"}]},
    {"prompt": "repeat hi twice"},
    {"prompt": [{"role": "user", "content": "reverse a b"}]},
    {"messages": [{"role": "user", "content": "  repeat   hi twice "}]},  # duplicate after normalization
    {"prompt": "list three colors"},
    {"prompt": "name two animals"},
]


def test_every_common_shape_becomes_a_prompt():
    assert qs.prompt_turns(ROWS[0]) == (("system", "Be brief."), ("user", "count to 3"))
    assert qs.prompt_turns(ROWS[1]) == (("user", "spell cat"),)
    assert qs.prompt_turns(ROWS[2]) == (("user", "repeat hi twice"),)
    assert qs.prompt_turns(ROWS[3]) == (("user", "reverse a b"),)


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "no user turn"),
        ({"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "hi"}]}, "no user turn"),
        ({"messages": []}, "no messages, conversations or prompt field"),
        ({"messages": [{"role": "user", "content": "   "}]}, "no user turn"),
        ({"text": "no conversation here"}, "no messages, conversations or prompt field"),
        ({"messages": [{"role": "user", "content": ["not", "text"]}]}, "user turn content is not text"),
        (["a", "list"], "row is not an object"),
    ],
)
def test_bad_rows_name_their_reason(row, reason):
    with pytest.raises(qs.BadRow, match=reason):
        qs.prompt_turns(row)


SPLIT_PART = {  # ShareGPT split long conversations into parts: this one starts with the assistant
    "conversations": [
        {"from": "gpt", "value": "...and that is the end of the story."},
        {"from": "chatgpt", "value": "Anything else?"},
        {"from": "human", "value": "  "},
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "shorter please"},
        {"from": "gpt", "value": "The end."},
        {"from": "human", "value": "thanks"},
        {"from": "human", "value": "one more?"},
        {"from": "bard", "value": "Sure."},
        {"from": "system", "value": "not here"},
        {"from": "human", "value": "bye"},
    ]
}


def test_all_turns_keep_every_user_turn_and_drop_the_sources_answers():
    """``all``: system first, then each user turn (those with no reply between them as one);
    leading assistant turns are skipped and said so; a late system turn is dropped."""
    messages, skipped = qs.conversation(SPLIT_PART, ALL)
    assert skipped and messages == (
        ("system", "Be brief."),
        ("user", "shorter please"),
        ("user", "thanks\n\none more?"),
        ("user", "bye"),
    )
    assert qs.conversation(SPLIT_PART, FIRST) == ((("system", "Be brief."), ("user", "shorter please")), True)
    assert qs.conversation(ROWS[0], ALL)[0] == (("system", "Be brief."), ("user", "count to 3"), ("user", "again"))
    assert qs.conversation(ROWS[1], ALL) == ((("user", "spell cat"),), False)
    assert qs.conversation({"prompt": ["write a poem", "now shorter"]}, ALL)[0] == (
        ("user", "write a poem"),
        ("user", "now shorter"),
    )


def test_leading_assistant_turns_are_counted_not_dropped(tmp_path, tiny_tokenizer):
    rows = [*ROWS, SPLIT_PART]
    first = q.run(settings(write_jsonl(tmp_path / "in.jsonl", rows), tiny_tokenizer), tmp_path / "first")
    every = q.run(settings(tmp_path / "in.jsonl", tiny_tokenizer, turns="all"), tmp_path / "all")
    assert first["leading_assistant_turns_skipped"] == every["leading_assistant_turns_skipped"] == 1
    assert first["bad_rows"] == every["bad_rows"] == 0 and first["questions"] == every["questions"] == 7
    assert (first["turns"], first["train_turns"]) == ("first", first["train"])
    user_turns = lambda name: [sum(m["role"] == "user" for m in r["messages"]) for r in read_jsonl(name)]  # noqa: E731
    train = user_turns(tmp_path / "all/shard_0.jsonl") + user_turns(tmp_path / "all/shard_1.jsonl")
    assert sorted(train + user_turns(tmp_path / "all/heldout.jsonl")) == [1, 1, 1, 1, 1, 2, 3]
    assert every["train_turns"] == sum(train)


def test_turns_after_the_first_do_not_have_to_fit_the_prompt_limit(tmp_path, tiny_tokenizer):
    """Only the first prompt is measured here; generation asks later turns while they fit."""
    rows = [{"prompt": ["spell cat", "word " * 500]}, {"prompt": "spell dog"}, {"prompt": "count to 3"}]
    summary = q.run(
        settings(write_jsonl(tmp_path / "in.jsonl", rows), tiny_tokenizer, turns="all", heldout=1), tmp_path / "o"
    )
    assert (summary["questions"], summary["too_long"]) == (3, 0)


def test_dedup_by_normalized_content_and_stable_ids(tmp_path, tiny_tokenizer):
    summary = q.run(settings(write_jsonl(tmp_path / "in.jsonl", ROWS), tiny_tokenizer), tmp_path / "out")
    assert summary["duplicates"] == 1
    assert summary["questions"] == 6
    first = all_ids(tmp_path / "out")
    assert len(first) == len(set(first)) == 6

    # Same content in another order and with other ids -> the same ids and the same split.
    q.run(settings(write_jsonl(tmp_path / "in2.jsonl", ROWS[::-1]), tiny_tokenizer), tmp_path / "out2")
    assert sorted(all_ids(tmp_path / "out2")) == sorted(first)
    heldout = lambda out: sorted(r["id"] for r in read_jsonl(out / "heldout.jsonl"))  # noqa: E731
    assert heldout(tmp_path / "out") == heldout(tmp_path / "out2")


def test_split_is_deterministic_and_a_seed_changes_it():
    pool = [qs.Question(f"q{i:04d}", (("user", f"question {i}"),)) for i in range(200)]
    shards_a, held_a = q.split_questions(pool, heldout=20, shards=4, seed=0)
    shards_b, held_b = q.split_questions(pool, heldout=20, shards=4, seed=0)
    _, held_c = q.split_questions(pool, heldout=20, shards=4, seed=1)
    assert held_a == held_b and shards_a == shards_b
    assert {x.id for x in held_a} != {x.id for x in held_c}
    assert sum(map(len, shards_a)) == 180 and all(len(s) > 20 for s in shards_a)
    assert not {x.id for x in held_a} & {x.id for s in shards_a for x in s}


def test_growing_the_pool_keeps_questions_in_their_shard():
    pool = [qs.Question(f"q{i:04d}", (("user", f"question {i}"),)) for i in range(300)]
    small, _ = q.split_questions(pool[:200], heldout=1, shards=3, seed=0)
    large, held = q.split_questions(pool, heldout=1, shards=3, seed=0)
    shard_of = {x.id: i for i, shard in enumerate(large) for x in shard}
    moved = [x.id for i, shard in enumerate(small) for x in shard if shard_of.get(x.id, i) != i]
    assert moved == []
    assert sum(map(len, small)) == 199 and len(shard_of) + len(held) == 300


def test_limit_applies_after_dedup(tmp_path, tiny_tokenizer):
    summary = q.run(
        settings(write_jsonl(tmp_path / "in.jsonl", ROWS), tiny_tokenizer, limit=5, heldout=1), tmp_path / "o"
    )
    assert summary["questions"] == 5 and summary["duplicates"] == 1


def test_bad_rows_are_counted_not_fatal(tmp_path, tiny_tokenizer):
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b'{"prompt": "good one"}\n'
        b"{not json\n"
        b'{"prompt": "caf\xff"}\n'
        b'{"messages": [{"role": "assistant", "content": "no question"}]}\n'
        b'{"prompt": "good two"}\n{"prompt": "good three"}\n'
    )
    summary = q.run(settings(path, tiny_tokenizer, heldout=1), tmp_path / "out")
    assert summary["questions"] == 3
    assert summary["bad_rows_by_reason"] == {
        "malformed JSON line": 1,
        "invalid UTF-8": 1,
        "no user turn": 1,
    }


def test_a_json_array_is_read_as_a_stream_and_a_cut_off_file_keeps_its_complete_rows(tmp_path, tiny_tokenizer):
    """ShareGPT's own JSON, as shipped: an array cut off mid-record, with conversations that
    start with the assistant or carry an empty first human turn. The first keeps its user
    turn (counted); the second has none, a counted bad row."""
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i}"}]} for i in range(4)]
    rows.append({"id": "a", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "x"}]})
    rows.append({"id": "e", "conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": "hm"}]})
    text = json.dumps(rows, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:-1] + ', {"id": "cut", "conversations": [{"from": "human", "value": "never fin')
    summary = q.run(settings(path, tiny_tokenizer, heldout=1), tmp_path / "out")
    assert summary["questions"] == 5 and summary["rows_read"] == 7
    assert summary["leading_assistant_turns_skipped"] == 1
    assert summary["bad_rows_by_reason"] == {"no user turn": 1, "file ends inside a record (cut off)": 1}
    broken = tmp_path / "broken.json"
    broken.write_text(text[:-1] + ", {not json}, " + json.dumps(rows[0]) + "]")
    assert (
        q.run(settings(broken, tiny_tokenizer, heldout=1), tmp_path / "b")["bad_rows_by_reason"][
            "malformed JSON: the rest of the file"
        ]
        == 1
    )
    (tmp_path / "object.json").write_text('{"rows": []}')
    with pytest.raises(qs.QuestionsError, match="must hold a JSON array of rows"):
        q.run(settings(tmp_path / "object.json", tiny_tokenizer), tmp_path / "c")


def test_zero_usable_questions_is_a_clear_error(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}, {"messages": []}])
    with pytest.raises(qs.QuestionsError, match="no usable questions"):
        q.run(settings(path, tiny_tokenizer), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_empty_or_missing_source_is_a_clear_error(tmp_path, tiny_tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(qs.QuestionsError, match="is empty"):
        q.run(settings(tmp_path / "empty.jsonl", tiny_tokenizer), tmp_path / "out")
    with pytest.raises(qs.QuestionsError, match="does not exist"):
        q.run(settings(tmp_path / "absent.jsonl", tiny_tokenizer), tmp_path / "out")


def test_heldout_larger_than_pool_is_a_clear_error(tmp_path, tiny_tokenizer):
    with pytest.raises(qs.QuestionsError, match="lower questions.heldout"):
        q.run(settings(write_jsonl(tmp_path / "in.jsonl", ROWS), tiny_tokenizer, heldout=6), tmp_path / "out")


def test_json_and_parquet_sources(tmp_path, tiny_tokenizer):
    rows = [{"prompt": f"question {i}"} for i in range(5)]
    (tmp_path / "in.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    from_json = q.run(settings(tmp_path / "in.json", tiny_tokenizer, heldout=1), tmp_path / "a")
    from_parquet = q.run(settings(tmp_path / "in.parquet", tiny_tokenizer, heldout=1), tmp_path / "b")
    assert from_json["questions"] == from_parquet["questions"] == 5
    assert sorted(all_ids(tmp_path / "a")) == sorted(all_ids(tmp_path / "b"))


def test_hugging_face_dataset_through_datasets(tmp_path, tiny_tokenizer):
    """A dataset directory in the hub layout loads through `datasets.load_dataset`."""
    repo = tmp_path / "org_dataset"
    (repo / "data").mkdir(parents=True)
    write_jsonl(
        repo / "data" / "train.jsonl", [{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(4)]
    )
    summary = q.run(settings(repo, tiny_tokenizer, heldout=1), tmp_path / "out")
    assert summary["questions"] == 4


def test_source_ids_are_ignored_so_duplicated_ones_cannot_merge_or_split_questions(tmp_path, tiny_tokenizer):
    rows = [
        {"id": "same", "prompt": "count to 3"},
        {"id": "same", "prompt": "spell dog"},  # the source reuses an id for other content
        {"id": "other", "prompt": "count to 3"},  # and gives the same content another id
    ]
    summary = q.run(
        settings(write_jsonl(tmp_path / "in.jsonl", rows), tiny_tokenizer, heldout=0, shards=1), tmp_path / "out"
    )
    assert summary["questions"] == 2 and summary["duplicates"] == 1
    kept = read_jsonl(tmp_path / "out" / "shard_0.jsonl")
    assert sorted(r["messages"][0]["content"] for r in kept) == ["count to 3", "spell dog"]
    assert len({r["id"] for r in kept}) == 2 and "same" not in {r["id"] for r in kept}


SAMPLE = Path(__file__).parent / "data" / "sharegpt_sample.json"


def test_a_sharegpt_file_as_shipped_keeps_what_fits_and_counts_every_bad_row_with_its_reason(tmp_path, tiny_tokenizer):
    """ShareGPT's layout with each kind of row real data holds: an over-long prompt, an
    assistant-first conversation (kept from its user turn), an empty first turn with no
    user turn after it and a record cut off by the file's end."""
    summary = q.run(settings(SAMPLE, tiny_tokenizer, heldout=1), tmp_path / "out")
    too_long = "prompt over 448 tokens (no room for generation.max_tokens 64 in server.max_model_len 512)"
    assert summary["bad_rows_by_reason"] == {
        "no user turn": 1,
        too_long: 1,
        "file ends inside a record (cut off)": 1,
    }
    assert (summary["rows_read"], summary["questions"], summary["too_long"]) == (8, 5, 1)
    assert summary["leading_assistant_turns_skipped"] == 1
    assert summary["max_prompt_tokens"] == 448
    kept = [m["content"] for r in read_jsonl(tmp_path / "out" / "heldout.jsonl") for m in r["messages"]]
    kept += [
        m["content"] for i in range(2) for r in read_jsonl(tmp_path / "out" / f"shard_{i}.jsonl") for m in r["messages"]
    ]
    assert "You are terse." in kept and not any(text.startswith("Please summarise") for text in kept)
    # A limit the user names lowers it further, and is the reason counted.
    summary = q.run(settings(SAMPLE, tiny_tokenizer, heldout=1, max_prompt_tokens=11), tmp_path / "low")
    assert summary["bad_rows_by_reason"]["prompt over questions.max_prompt_tokens 11"] == summary["too_long"] == 2
    assert (summary["max_prompt_tokens"], summary["questions"]) == (11, 4)


def test_the_limit_counts_questions_that_fit(tmp_path, tiny_tokenizer):
    """questions.limit is on usable questions: one dropped as too long does not use up the limit."""
    long_first = [{"prompt": "word " * 500}] + [{"prompt": f"question {n}"} for n in range(4)]
    summary = q.run(
        settings(write_jsonl(tmp_path / "in.jsonl", long_first), tiny_tokenizer, limit=3, heldout=1), tmp_path / "o"
    )
    assert (summary["questions"], summary["too_long"], summary["rows_read"]) == (3, 1, 4)
