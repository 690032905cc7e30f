"""Stopping a whole workflow run at a chosen point, as a crash or a Ctrl-C would, and reading
what it had done by then (test_workflow.py's interrupted demo run)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from conftest import heavy_processes_after
from snakemake.utils import validate

from draftsmith import questions
from draftsmith.run_config import RunConfig

RUN = [sys.executable, "-m", "snakemake", "--cores", "all", "--resources", "gpu=8"]


def count(pattern: str, workdir: Path) -> int:
    return len(list(workdir.glob(pattern)))


def staged_answers(workdir: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in workdir.glob("results/.staging/completions/*/records.jsonl"))


def log_says(workdir: Path, name: str, text: str = "") -> bool:
    log = workdir / "results/logs" / name
    return log.exists() and text in log.read_text(errors="replace")


def run_until(
    workdir: Path, condition, timeout: float = 1800, stop: int = signal.SIGKILL, options: tuple[str, ...] = ()
) -> None:
    """Start the workflow (with ``options``) and send `stop` to its whole process group once
    `condition()` holds."""
    process = subprocess.Popen(
        [*RUN, *options],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # SIGINT as a terminal's foreground job has it, even when this suite runs under
        # `nohup ... &` (which starts it ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + timeout
    try:
        while not condition():
            assert process.poll() is None, "the workflow ended before the kill point"
            assert time.monotonic() < deadline, "kill point not reached"
            time.sleep(0.2)
    except AssertionError:
        if process.poll() is None:  # nothing of this run outlives the failed stop
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=300)
        raise
    os.killpg(process.pid, stop)
    # After SIGINT Snakemake waits for its jobs to stop their servers; on a loaded 2-core
    # machine that once took more than 120 s, so allow 300 s.
    process.wait(timeout=300)
    # Each server's and trainer's guard stops its whole group when its stage dies.
    assert heavy_processes_after(20) == []


def unlock(workdir: Path) -> None:
    """What a user runs after a SIGKILL (Snakemake had no chance to release its lock)."""
    subprocess.run([sys.executable, "-m", "snakemake", "--unlock"], cwd=workdir, check=True, capture_output=True)


def uninterrupted_question_ids(workdir: Path, scratch: Path) -> list[str]:
    """The ids the questions stage plans when nothing interrupts it."""
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    validate(config, str(workdir / "workflow/schemas/config.schema.yaml"))
    config["questions"]["source"] = str(workdir / config["questions"]["source"])
    config["target"]["model"] = str(workdir / config["target"]["model"])  # its tokenizer measures the prompts
    questions.run(RunConfig.from_dict(config), scratch / "questions")
    return sorted(
        json.loads(line)["id"]
        for p in (scratch / "questions").glob("shard_*.jsonl")
        for line in p.read_text().splitlines()
    )
