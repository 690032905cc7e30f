"""Kill the whole workflow (SIGKILL to Snakemake's process group) during question prep,
generation, dataset, extraction and training; rerun with the documented commands after each
kill (evaluation keeps no work in progress: a killed measurement job just runs again). The
rerun completes with the ids an uninterrupted run plans, asks only for what was missing, and
leaves no server or trainer behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow, heavy_processes, heavy_processes_after
from snakemake.utils import validate

from draftsmith import questions

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
RUN = [sys.executable, "-m", "snakemake", "--cores", "all", "--resources", "gpu=8"]


def count(pattern: str, workdir: Path) -> int:
    return len(list(workdir.glob(pattern)))


def records(workdir: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in workdir.glob("results/.staging/completions/*/records.jsonl"))


def run_until(workdir: Path, condition, timeout: float = 900, stop: int = signal.SIGKILL) -> None:
    """Start the workflow and send `stop` to its whole process group once `condition()` holds."""
    process = subprocess.Popen(
        RUN,
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # SIGINT as a terminal's foreground job has it, even when this suite runs under
        # `nohup ... &` (which starts it ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, "the workflow ended before the kill point"
        assert time.monotonic() < deadline, "kill point not reached"
        time.sleep(0.2)
    os.killpg(process.pid, stop)
    # After SIGINT Snakemake waits for its jobs to stop their servers; on a loaded 2-core
    # machine that once took more than 120 s (CI, session 6), so allow 300 s.
    process.wait(timeout=300)
    # Each server's and trainer's guard stops its whole group when its stage dies.
    assert heavy_processes_after(20) == []


def small_workflow(workdir: Path, questions: int, target: Path) -> Path:
    copy_workflow(workdir)
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    # Small and quick: the tests are about resuming, not about the drafter's quality.
    config["questions"].update(limit=questions, heldout=20)
    config["training"]["epochs"] = 6
    config["evaluation"].update(
        compare_untrained=False, num_speculative_tokens=3, concurrency=8, sampled=False, sets={}
    )
    # The suite's demo target, built once: building one per test cost two minutes each.
    config["target"].update(model=str(target), build_demo=False)
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config))
    return workdir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, demo_target):
    return small_workflow(tmp_path_factory.mktemp("crash"), questions=240, target=demo_target)


def rerun_after_kill(workdir: Path) -> None:
    subprocess.run([sys.executable, "-m", "snakemake", "--unlock"], cwd=workdir, check=True, capture_output=True)


def log_says(workdir: Path, name: str, text: str = "") -> bool:
    log = workdir / "results/logs" / name
    return log.exists() and text in log.read_text(errors="replace")


def uninterrupted_question_ids(workdir: Path, tmp_path: Path) -> list[str]:
    """The ids the questions stage plans when nothing interrupts it."""
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    validate(config, str(workdir / "workflow/schemas/config.schema.yaml"))
    config["questions"]["source"] = str(workdir / config["questions"]["source"])
    questions.run(config, tmp_path / "questions")
    return sorted(
        json.loads(line)["id"]
        for p in (tmp_path / "questions").glob("shard_*.jsonl")
        for line in p.read_text().splitlines()
    )


def test_kill_anywhere_then_rerun_completes_without_redoing_work(workdir, tmp_path):
    run_until(workdir, lambda: log_says(workdir, "questions.log"))  # during question prep
    rerun_after_kill(workdir)

    run_until(workdir, lambda: records(workdir) >= 60)  # during generation
    answered_before = records(workdir)
    rerun_after_kill(workdir)

    run_until(workdir, lambda: log_says(workdir, "dataset.log", "prepare"))  # during dataset
    rerun_after_kill(workdir)

    run_until(workdir, lambda: count("results/.staging/hidden_states/*/hs_*.safetensors", workdir) >= 70)
    rerun_after_kill(workdir)
    summaries = [json.loads(p.read_text()) for p in workdir.glob("results/.staging/completions/*/summary.json")]
    assert sum(s["asked_this_run"] for s in summaries) <= sum(s["questions"] for s in summaries) - answered_before

    run_until(workdir, lambda: count("results/.staging/train/checkpoints/[0-9]*/training_state.json", workdir) >= 2)
    rerun_after_kill(workdir)
    epochs_before = count("results/.staging/train/checkpoints/[0-9]*", workdir)

    final = subprocess.run(RUN, cwd=workdir, capture_output=True, text=True, timeout=1800)
    assert final.returncode == 0, final.stderr[-4000:]
    assert heavy_processes() == []

    # The sample ids of an uninterrupted run: none lost, none twice.
    planned = sorted(
        json.loads(line)["id"]
        for p in workdir.glob("results/questions/shard_*.jsonl")
        for line in p.read_text().splitlines()
    )
    assert planned == uninterrupted_question_ids(workdir, tmp_path)
    answered = [
        json.loads(line)["id"]
        for p in workdir.glob("results/completions/shard_*.jsonl")
        for line in p.read_text().splitlines()
    ]
    assert sorted(answered) == planned
    row_ids = json.loads((workdir / "results/dataset/row_ids.json").read_text())
    assert sorted(row_ids) == planned
    assert count("results/hidden_states/all/hs_*.safetensors", workdir) == len(row_ids)
    # Training resumed from its checkpoints instead of starting over.
    train_log = (workdir / "results/logs/train.log").read_text()
    assert epochs_before >= 2 and "Resuming training on epoch" in train_log
    assert json.loads((workdir / "results/eval/acceptance.json").read_text())["acceptance_length"] > 1.0


def test_ctrl_c_stops_jobs_and_servers_and_the_same_command_resumes(tmp_path, demo_target):
    """Ctrl-C in a terminal: SIGINT to the whole foreground group. Each stage stops its own
    server (in its own session, so the terminal's SIGINT does not reach it); Snakemake
    exits and releases its lock; the same command asks only for the questions not answered."""
    workdir = small_workflow(tmp_path / "ctrl_c", questions=240, target=demo_target)
    run_until(workdir, lambda: records(workdir) >= 30, stop=signal.SIGINT)  # asserts nothing is left
    answered_before = records(workdir)
    targets = [f"results/completions/shard_{shard}.jsonl" for shard in (0, 1)]
    rerun = subprocess.run(
        [sys.executable, "-m", "snakemake", *targets, *RUN[3:]],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in workdir.glob("results/.staging/completions/*/summary.json")]
    assert sum(s["asked_this_run"] for s in summaries) == sum(s["questions"] for s in summaries) - answered_before
