"""The dataset stage's merge: the same answers make the same rows, however they were sharded."""

import json

from draftsmith.dataset import merge_completions


def write_shards(directory, shards):
    paths = []
    for index, records in enumerate(shards):
        path = directory / f"shard_{index}.jsonl"
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
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
    ids_two = merge_completions(two, tmp_path / "two.jsonl", seq_length=2)
    ids_one = merge_completions(one, tmp_path / "one.jsonl", seq_length=2)
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert ids_two == ids_one
    merged = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert [row["input_ids"][0] for row in merged] == [0, 1, 2, 3, 4, 5]  # question-id order
