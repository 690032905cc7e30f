"""The training view links every row once and copies no tensor data."""

import os

import pytest
from conftest import write_shard_manifest

from draftsmith.training_view import TrainingViewError, build_view


def make_shards(tmp_path, layout):
    shards = []
    for index, rows in enumerate(layout):
        shard = tmp_path / f"shard_{index}"
        shard.mkdir()
        for row in rows:
            (shard / f"hs_{row}.safetensors").write_bytes(os.urandom(64))
        shards.append(shard)
    return shards


def test_links_every_row_without_copying(tmp_path):
    shards = make_shards(tmp_path, [[0, 1, 2], [3, 4]])
    view = tmp_path / "all"
    build_view(shards, 5, view)
    links = sorted(view.iterdir())
    assert [p.name for p in links] == [f"hs_{r}.safetensors" for r in (0, 1, 2, 3, 4)]
    assert all(p.is_symlink() and not os.path.isabs(os.readlink(p)) for p in links)
    assert (view / "hs_3.safetensors").read_bytes() == (shards[1] / "hs_3.safetensors").read_bytes()
    # Relative links: the results directory can move as a whole.
    moved = tmp_path.rename(tmp_path.with_name(tmp_path.name + "_moved"))
    assert (moved / "all" / "hs_0.safetensors").read_bytes() == (moved / "shard_0" / "hs_0.safetensors").read_bytes()


def test_missing_rows_are_named(tmp_path):
    with pytest.raises(TrainingViewError, match=r"2 dataset rows have no hidden states \(first: \[2, 4\]\)"):
        build_view(make_shards(tmp_path, [[0, 1], [3]]), 5, tmp_path / "all")
    assert not (tmp_path / "all").exists()


def test_a_row_in_two_shards_is_refused(tmp_path):
    with pytest.raises(TrainingViewError, match="row 1 is in both"):
        build_view(make_shards(tmp_path, [[0, 1], [1, 2]]), 3, tmp_path / "all")


def with_manifest(shard, stored_rows):
    return write_shard_manifest(shard, stored_rows=stored_rows)


def test_under_a_disk_budget_the_view_covers_the_stored_rows_only(tmp_path):
    shards = [with_manifest(s, 3) for s in make_shards(tmp_path, [[0, 1], [2]])]
    build_view(shards, 10, tmp_path / "all")
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == [f"hs_{r}.safetensors" for r in (0, 1, 2)]


def test_a_stored_row_missing_under_a_budget_is_still_an_error(tmp_path):
    shards = [with_manifest(s, 3) for s in make_shards(tmp_path, [[0], [2]])]
    with pytest.raises(TrainingViewError, match="1 dataset rows have no hidden states"):
        build_view(shards, 10, tmp_path / "all")


def test_shards_of_different_budgets_do_not_mix(tmp_path):
    first, second = make_shards(tmp_path, [[0], [1]])
    with pytest.raises(TrainingViewError, match="different disk budgets"):
        build_view([with_manifest(first, 2), with_manifest(second, 4)], 10, tmp_path / "all")


def test_no_shards_is_an_empty_view_for_fully_online_training(tmp_path):
    build_view([], 10, tmp_path / "all")
    assert list((tmp_path / "all").iterdir()) == []
