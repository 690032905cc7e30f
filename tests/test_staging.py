"""Staged partial work is reused only under the settings that made it."""

from draftsmith.staging import FINGERPRINT, open_staging


def test_same_settings_keep_staged_work(tmp_path):
    staging = open_staging(tmp_path / "s", {"layers": [2, 3, 5, 6]})
    (staging / "hs_0.safetensors").write_bytes(b"x")
    open_staging(tmp_path / "s", {"layers": [2, 3, 5, 6]})
    assert (staging / "hs_0.safetensors").exists()


def test_changed_settings_set_stale_work_aside(tmp_path):
    staging = open_staging(tmp_path / "s", {"layers": [2, 3, 5, 6]})
    (staging / "hs_0.safetensors").write_bytes(b"x")
    open_staging(tmp_path / "s", {"layers": [1, 3, 5, 6]})
    assert not (staging / "hs_0.safetensors").exists()
    assert '"layers": [\n      1,' in (staging / FINGERPRINT).read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # the stale copy is removed


def test_staging_from_before_fingerprints_is_not_trusted(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "records.jsonl").write_text("{}\n")
    open_staging(tmp_path / "s", {"max_tokens": 64})
    assert not (tmp_path / "s" / "records.jsonl").exists()
