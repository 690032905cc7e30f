"""Faults under a running generation stage: the server dies mid-stage, the disk fills up.
Each ends in one clear failure within seconds, never a published partial, and a rerun
asks only for what is missing."""

import json
import subprocess
import sys
import time

import psutil
import pytest
from conftest import heavy_processes_after, server_settings
from test_generate import GENERATION, assert_complete_and_well_formed, write_questions

from draftsmith import generate
from draftsmith.run_config import RunConfig

pytestmark = pytest.mark.vllm


def stage_command(settings, tmp_path):
    return [
        sys.executable,
        "-m",
        "draftsmith.generate",
        "--settings",
        json.dumps(settings),
        "--questions",
        str(tmp_path / "q.jsonl"),
        "--staging",
        str(tmp_path / "staging"),
        "--output",
        str(tmp_path / "out.jsonl"),
    ]


def test_server_death_mid_stage_fails_within_seconds_and_a_rerun_resumes(demo_target, tmp_path):
    questions = write_questions(tmp_path / "q.jsonl", 40)
    settings = server_settings(demo_target) | {"generation": GENERATION | {"concurrency": 2, "max_retries": 3}}
    records, log_path = tmp_path / "staging" / generate.RECORDS, tmp_path / "stage.log"
    with log_path.open("w") as log:
        stage = subprocess.Popen(stage_command(settings, tmp_path), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while not (records.exists() and len(records.read_text().splitlines()) >= 5):
            assert stage.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        # What an out-of-memory kill does: the engine process dies, the stage lives on.
        below = psutil.Process(stage.pid).children(recursive=True)
        engines = [p for p in below if "VLLM::EngineCore" in " ".join(p.cmdline())]
        assert engines, [p.cmdline() for p in below]
        killed_at = time.monotonic()
        for engine in engines:
            engine.kill()
        returncode = stage.wait(timeout=120)
    noticed_after = time.monotonic() - killed_at

    last_line = log_path.read_text().strip().splitlines()[-1]
    assert returncode == 2, log_path.read_text()[-3000:]
    assert "ERROR: vLLM server died mid-stage" in log_path.read_text() and "rerun resumes" in log_path.read_text(), (
        last_line
    )
    # Without the watch, 35 questions x 4 attempts with back-off would take minutes.
    assert noticed_after < 30, f"the stage took {noticed_after:.0f}s to notice"
    assert not (tmp_path / "out.jsonl").exists()
    assert heavy_processes_after(20) == []

    answered_before = len(generate.load_records(records))
    generate.run(
        RunConfig.from_dict(settings), tmp_path / "q.jsonl", tmp_path / "staging", tmp_path / "out.jsonl", None
    )
    summary = json.loads((tmp_path / "staging" / "summary.json").read_text())
    assert summary["asked_this_run"] == 40 - answered_before
    assert_complete_and_well_formed(tmp_path / "out.jsonl", questions)


@pytest.fixture
def small_disk(tmp_path):
    """A 16 KiB filesystem: room for about twenty answers, not forty."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_fails_with_one_clear_line_keeps_whole_records_and_a_rerun_resumes(
    demo_target, small_disk, tmp_path
):
    questions = write_questions(tmp_path / "q.jsonl", 40)
    settings = server_settings(demo_target) | {"generation": GENERATION}
    command = stage_command(settings, tmp_path)
    command[command.index("--staging") + 1] = str(small_disk / "staging")
    command[command.index("--output") + 1] = str(small_disk / "out.jsonl")

    full = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert full.returncode == 2, full.stderr[-3000:]
    last_line = full.stderr.strip().splitlines()[-1]
    assert "ERROR: no space left on device" in last_line and "rerun the same command" in last_line, last_line
    assert not (small_disk / "out.jsonl").exists()
    # Only whole records: every line parses (the failed append was cut back off).
    records = small_disk / "staging" / generate.RECORDS
    kept = [json.loads(line) for line in records.read_bytes().decode().splitlines()]
    assert 0 < len(kept) < 40 and records.read_bytes().endswith(b"\n")
    assert heavy_processes_after(20) == []

    subprocess.run(["mount", "-o", "remount,size=1m", str(small_disk)], check=True)  # space freed
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((small_disk / "staging" / "summary.json").read_text())
    assert summary["asked_this_run"] == 40 - len(kept)
    assert_complete_and_well_formed(small_disk / "out.jsonl", questions)
