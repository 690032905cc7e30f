"""The dataset stage: the same answers make the same rows, however they were sharded, and
every row keeps its question's id."""

import json

from conftest import generation_line

from draftsmith import dataset
from draftsmith.dataset import merge_completions
from draftsmith.records import CapturedRows, RowIds
from draftsmith.run_config import RunConfig


def write_shards(directory, shards):
    paths = []
    for index, records in enumerate(shards):
        path = directory / f"shard_{index}.jsonl"
        path.write_text("".join(generation_line(**record) for record in records))
        paths.append(path)
    return paths


def test_the_merged_rows_do_not_depend_on_how_questions_were_sharded(tmp_path):
    """prepare-data shuffles with a fixed seed, so an identical merged file means an identical
    dataset, and every extracted row stays valid after a re-sharding."""
    records = [{"id": f"q{i}", "input_ids": [i, i + 1, i + 2], "loss_mask": [0, 1, 1]} for i in range(6)]
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    two = write_shards(tmp_path / "two", [[records[0], records[3], records[4]], [records[5], records[1], records[2]]])
    one = write_shards(tmp_path / "one", [list(reversed(records))])
    ids_two, _ = merge_completions(two, tmp_path / "two.jsonl", seq_length=2)
    ids_one, _ = merge_completions(one, tmp_path / "one.jsonl", seq_length=2)
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert ids_two == ids_one
    merged = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert [row["input_ids"][0] for row in merged] == [0, 1, 2, 3, 4, 5]  # question-id order


def test_answers_cut_to_the_same_row_keep_every_question_id(tiny_tokenizer, tmp_path):
    """Real prepare-data on a tiny tokenizer. Two answers whose first seq_length tokens are
    equal become the same row; each question id is given once, none is lost or repeated."""
    seq_length = 6
    shared = [1, 5, 6, 7, 8, 9]
    records = [
        {"id": "q-a", "input_ids": shared + [10, 11], "loss_mask": [0, 0, 1, 1, 1, 1, 1, 1]},
        {"id": "q-b", "input_ids": shared + [12], "loss_mask": [0, 0, 1, 1, 1, 1, 1]},
        {"id": "q-c", "input_ids": [1, 20, 21, 22, 23], "loss_mask": [0, 1, 1, 1, 1]},
        {"id": "q-d", "input_ids": [1, 30, 31, 32], "loss_mask": [0, 0, 1, 1]},
    ]
    shards = write_shards(tmp_path, [records[:2], records[2:]])
    settings = {
        "target": {"model": str(tiny_tokenizer), "trust_remote_code": False},
        "dataset": {"seq_length": seq_length, "min_trainable_tokens": 1},
        "hidden_states": {"capture": "separate"},
    }
    dataset.run(RunConfig.from_dict(settings), shards, tmp_path / "staging", tmp_path / "out")
    row_ids = RowIds.read(tmp_path / "out").ids
    assert sorted(row_ids) == ["q-a", "q-b", "q-c", "q-d"]
    from datasets import load_from_disk

    rows = load_from_disk(str(tmp_path / "out")).with_format(None)["input_ids"]
    by_id = {question: tuple(row) for question, row in zip(row_ids, rows, strict=True)}
    assert by_id["q-a"] == by_id["q-b"] == tuple(shared)
    assert by_id["q-c"] == (1, 20, 21, 22, 23) and by_id["q-d"] == (1, 30, 31, 32)


def test_one_pass_rows_end_before_the_final_token_and_captured_rows_come_first(tiny_tokenizer, tmp_path):
    """hidden_states.capture during_generation: the final answer token has no captured state,
    so every row drops it; rows whose states were captured lead, in prepare-data's order, and
    their count is recorded (a disk budget stores at most those)."""
    from datasets import load_from_disk

    records = [
        {
            "id": f"q{i}",
            "input_ids": [1, 10 + i, 20 + i, 30 + i, 2],
            "loss_mask": [0, 1, 1, 1, 1],
            "captured": i % 3 == 0,
        }
        for i in range(9)
    ]
    shards = write_shards(tmp_path, [records])
    settings = {
        "target": {"model": str(tiny_tokenizer), "trust_remote_code": False},
        "dataset": {"seq_length": 16, "min_trainable_tokens": 1},
        "hidden_states": {"capture": "during_generation"},
    }
    dataset.run(RunConfig.from_dict(settings), shards, tmp_path / "staging", tmp_path / "out")
    row_ids = RowIds.read(tmp_path / "out").ids
    rows = load_from_disk(str(tmp_path / "out")).with_format(None)
    assert set(row_ids[:3]) == {"q0", "q3", "q6"}
    assert CapturedRows.read(tmp_path / "out") == CapturedRows(captured=3, rows=9)
    for question, input_ids, loss_mask in zip(row_ids, rows["input_ids"], rows["loss_mask"], strict=True):
        i = int(question[1:])
        assert input_ids == [1, 10 + i, 20 + i, 30 + i] and loss_mask == [0, 1, 1, 1]
    assert (tmp_path / "out" / "token_freq.pt").is_file()


def test_one_pass_counts_the_final_answer_tokens_the_rows_leave_out(tmp_path):
    """One pass: each row ends before its final answer token (almost always the end of the
    turn). The draft vocabulary comes from the token counts, so those tokens are added to
    them, or the drafter could never propose the end of an answer."""
    from collections import Counter

    import torch

    end = 2
    records = [{"id": f"q{i}", "input_ids": [1, 7, 8 + i, end], "loss_mask": [0, 1, 1, 1]} for i in range(3)]
    records.append({"id": "q-cut", "input_ids": [1, 7, 30], "loss_mask": [0, 0, 0]})  # no answer token last
    (tmp_path / "shards").mkdir()
    dropped: Counter[int] = Counter()
    merge_completions(write_shards(tmp_path / "shards", [records]), tmp_path / "merged.jsonl", 16, True, dropped)
    rows = [json.loads(line)["input_ids"] for line in (tmp_path / "merged.jsonl").read_text().splitlines()]
    assert all(end not in row for row in rows)  # the rows leave it out...
    assert dropped == Counter({end: 3})  # ...and it is counted once per answer
    frequencies = tmp_path / "token_freq.pt"
    torch.save({7: 3, 8: 1}, frequencies)
    dataset.count_final_tokens(frequencies, dropped)
    assert torch.load(frequencies) == {7: 3, 8: 1, end: 3}
