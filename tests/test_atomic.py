"""Outputs appear whole or not at all, even when the disk fills mid-write."""

import errno

import pytest

from draftsmith import atomic
from draftsmith.atomic import atomic_write_text, publish_directory


def test_a_failed_write_keeps_the_old_file_and_leaves_no_partial(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_text("old\n")

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(target, "new\n")
    assert target.read_text() == "old\n"
    assert list(tmp_path.iterdir()) == [target]  # the .partial is gone too


def test_a_write_replaces_the_file_whole(tmp_path):
    target = tmp_path / "deep" / "summary.json"
    atomic_write_text(target, "first\n")
    atomic_write_text(target, "second\n")
    assert target.read_text() == "second\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["summary.json"]


def test_publishing_a_directory_replaces_a_stale_one(tmp_path):
    final = tmp_path / "hidden_states" / "shard_0"
    final.mkdir(parents=True)
    (final / "stale.safetensors").write_text("x")
    staged = tmp_path / ".shard_0.publishing"
    staged.mkdir()
    (staged / "hs_0.safetensors").write_text("y")
    publish_directory(staged, final)
    assert [p.name for p in final.iterdir()] == ["hs_0.safetensors"]
    assert not staged.exists()
