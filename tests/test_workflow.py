"""The demo DAG end to end through Snakemake, on a copy of the workflow (the slowest test).

One real run of the shipped demo config (real vLLM CPU build, real speculators), then:
the wiring proof (trained drafter vs untrained), nothing left to do on a rerun, a
generation change re-plans exactly generation and what follows, no server left behind,
and the HTML report.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow, heavy_processes

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
pytestmark = pytest.mark.e2e


def snakemake(workdir: Path, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True, timeout=timeout
    )


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


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo")
    copy_workflow(workdir)
    run = snakemake(workdir, "--cores", "all", "--resources", "gpu=8")
    assert run.returncode == 0, run.stderr[-5000:]
    return workdir


def test_demo_reaches_the_acceptance_goal_and_beats_an_untrained_drafter(demo_run):
    result = json.loads((demo_run / "results/eval/acceptance.json").read_text())
    for key in ("acceptance_length", "acceptance_per_position", "tokens_per_s_with_drafter",
                "tokens_per_s_without_drafter"):  # fmt: skip
        assert key in result
    assert len(result["acceptance_per_position"]) == 3
    assert result["acceptance_length"] >= 2.5, result
    assert result["acceptance_length"] > result["untrained_acceptance_length"] + 1.0, result
    assert (demo_run / "results/eval/acceptance.png").stat().st_size > 10_000


def test_drafter_carries_the_extracted_layers(demo_run):
    drafter = json.loads((demo_run / "results/drafter/config.json").read_text())
    manifest = json.loads((demo_run / "results/hidden_states/shard_0/manifest.json").read_text())
    # Outputs of layers 1, 2, 4 (+ the final 5) are vLLM ids 2, 3, 5 (+ 6).
    assert manifest["vllm_layer_ids"] == [2, 3, 5, 6]
    assert drafter["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    spec = json.loads((demo_run / "results/drafter_speculative_config.json").read_text())
    assert spec["method"] == "eagle3" and Path(spec["model"]) == (demo_run / "results/drafter").resolve()


def test_every_question_is_answered_once_and_traceable(demo_run):
    summary = json.loads((demo_run / "results/questions/summary.json").read_text())
    answered = [
        json.loads(line)["id"]
        for shard in sorted((demo_run / "results/completions").glob("shard_*.jsonl"))
        for line in shard.read_text().splitlines()
    ]
    assert len(answered) == len(set(answered)) == summary["train"]
    row_ids = json.loads((demo_run / "results/dataset/row_ids.json").read_text())
    assert sorted(row_ids) == sorted(answered)
    links = list((demo_run / "results/hidden_states/all").glob("hs_*.safetensors"))
    assert len(links) == len(row_ids) and all(link.is_symlink() for link in links)


def test_second_run_has_nothing_to_do_and_no_server_is_left(demo_run):
    assert heavy_processes() == []
    rerun = snakemake(demo_run, "-n")
    assert rerun.returncode == 0
    assert "Nothing to be done" in rerun.stdout + rerun.stderr


def test_a_generation_change_replans_generation_and_what_follows(demo_run):
    config = yaml.safe_load((demo_run / "config/config.yaml").read_text())
    config["generation"]["max_tokens"] = 48
    changed = demo_run / "config" / "changed.yaml"
    changed.write_text(yaml.safe_dump(config))
    plan = snakemake(demo_run, "-n", "--configfile", str(changed))
    assert plan.returncode == 0, plan.stderr[-3000:]
    jobs = planned_jobs(plan.stdout)
    assert jobs.get("generate") == config["questions"]["shards"]
    assert {"dataset", "extract", "train", "evaluate"} <= jobs.keys()
    assert "demo_model" not in jobs and "questions" not in jobs


def test_report_holds_the_plots(demo_run):
    report = demo_run / "report.html"
    run = snakemake(demo_run, "--report", str(report))
    assert run.returncode == 0, run.stderr[-3000:]
    html = report.read_text(errors="replace")
    assert report.stat().st_size > 50_000
    for expected in ("acceptance.png", "plan.txt"):
        assert expected in html
