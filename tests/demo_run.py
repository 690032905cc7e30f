"""The finished demo that the end-to-end modules share (test_workflow, test_rerun_matrix): one
real run of the shipped demo config (real vLLM CPU build, real speculators), stopped the way
users stop runs in every stage that keeps work in progress (SIGKILL to the whole process group
during question prep, dataset and training; Ctrl-C during generation, which also captures the
answers' hidden states: the demo runs in one pass, so its extraction only links those files
and has no work in progress to lose) and resumed each time with the documented command.

One run serves all of them (a session fixture, through conftest.py): a run per concern cost
about 25 minutes more of CI on 2 cores.
"""

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow
from interrupt import count, log_says, run_until, staged_answers, unlock

SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def snakemake(workdir: Path, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True, timeout=timeout)


def planned_jobs(output: str) -> dict[str, int]:
    """Rule -> count from the 'Job stats' table of a dry run."""
    jobs, in_table = {}, False
    for line in output.splitlines():
        if line.startswith("job ") and "count" in line:
            in_table = True
            continue
        if in_table:
            parts = line.split()
            if not parts or parts[0].startswith("-"):
                continue
            if parts[0] == "total":
                break
            jobs[parts[0]] = int(parts[1])
    return jobs


@dataclass
class Interruptions:
    """What the interrupted demo run had done at its stops."""

    answered_before_ctrl_c: int
    asked_after_ctrl_c: int
    questions: int
    checkpoints_before_kill: int


def interrupt_every_stage(workdir: Path) -> Interruptions:
    """Stop the demo in every stage that keeps work in progress, resuming with the same command."""
    checkpoints = "results/.staging/train/checkpoints/[0-9]*/training_state.json"

    run_until(workdir, lambda: log_says(workdir, "questions.log"))  # SIGKILL during question prep
    unlock(workdir)
    # Ctrl-C in a terminal: SIGINT to the whole foreground group. Each stage stops its own
    # server; Snakemake exits and releases its lock, so the same command runs next.
    run_until(workdir, lambda: staged_answers(workdir) >= 60, stop=signal.SIGINT)
    answered_before = staged_answers(workdir)
    run_until(workdir, lambda: log_says(workdir, "dataset.log", "prepare"))  # generation is done
    summaries = [json.loads(p.read_text()) for p in workdir.glob("results/.staging/completions/*/summary.json")]
    unlock(workdir)
    run_until(workdir, lambda: count(checkpoints, workdir) >= 2)
    unlock(workdir)
    return Interruptions(
        answered_before_ctrl_c=answered_before,
        asked_after_ctrl_c=sum(s["asked_this_run"] for s in summaries),
        questions=sum(s["questions"] for s in summaries),
        checkpoints_before_kill=count("results/.staging/train/checkpoints/[0-9]*", workdir),
    )


@pytest.fixture(scope="session")
def interrupted_demo(tmp_path_factory) -> tuple[Path, Interruptions | str]:
    """The demo, stopped in every stage and finished by the same command. A stop that does not
    happen as planned is reported (a string) to the resume test alone: the checks of the
    finished run do not depend on it."""
    workdir = copy_workflow(tmp_path_factory.mktemp("demo"))
    stops: Interruptions | str
    try:
        stops = interrupt_every_stage(workdir)
    except AssertionError as error:
        stops = f"a stop did not happen as planned: {error}"
        unlock(workdir)
    final = snakemake(workdir, "--cores", "all", "--resources", "gpu=8")
    assert final.returncode == 0, final.stderr[-5000:]
    return workdir, stops


@pytest.fixture(scope="session")
def demo_run(interrupted_demo) -> Path:
    return interrupted_demo[0]


def demo_config(workdir: Path) -> dict:
    return yaml.safe_load((workdir / "config/config.yaml").read_text())


def dry_run(workdir: Path, config: dict, name: str) -> dict[str, int]:
    """The jobs ``snakemake -n`` plans for ``config`` in ``workdir`` (rule -> count)."""
    path = workdir / "config" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    plan = snakemake(workdir, "-n", "--configfile", str(path), timeout=300)
    assert plan.returncode == 0, f"{name}: {plan.stderr[-3000:]}"
    jobs = planned_jobs(plan.stdout)
    jobs.pop("all", None)
    return jobs
