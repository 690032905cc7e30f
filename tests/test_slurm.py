"""The demo DAG through Snakemake's SLURM executor plugin, on a real SLURM cluster (slow).

Needs sbatch on PATH, a controller that answers (`sudo tests/slurm/setup_cluster.sh` starts
two nodes on this host) and the plugin (tests/slurm/run_slurm_test.sh sets both up); skipped otherwise.
One run with profiles/slurm-cpu on a copy of the workflow: the demo config made small (the
suite's demo target, 160 questions, 2 generation and 2 extraction shards, 3 epochs, one
draft length, EAGLE-3 and P-EAGLE), since the drafter's quality is test_workflow.py's
concern. Then: every heavy job, each shard included, was its own SLURM job and SLURM
recorded it as completed, the cheap rules stayed on the submit host, the question ids are
those of a local run of the questions stage, both drafters were served and drafted, and a
rerun has nothing to do.

CI (.ci/run) starts the one-host cluster and installs the plugin's overlay (`make
slurm-site`); the overlay goes on PYTHONPATH of this test's Snakemake runs only, since its
numpy is not the one the rest of the suite runs with.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow

from draftsmith.records import RowIds

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
PROFILE = ["--workflow-profile", "slurm-cpu"]
SLURM_SITE = ROOT / ".slurm-site"  # `make slurm-site`
SHARDED = {"generate": 2, "extract": 2}  # the demo config's shards
ONE_JOB = {"dataset", "train", "train_kind", "evaluate_baseline", "evaluate_drafter", "evaluate_kind"}
LOCAL = {
    "questions",
    "training_view",
    "evaluation_sets",
    "evaluate",
    "plan_snapshot",
    "completion_lengths",
    "training_curves",
    "run_metadata",
}
SUBMITTED = re.compile(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: (\S+)\)")


def _unavailable() -> str | None:
    """Why this machine cannot run the test, or None."""
    if shutil.which("sbatch") is None:
        return "no SLURM here (sbatch not on PATH); start one with: sudo tests/slurm/setup_cluster.sh"
    if not (SLURM_SITE / "snakemake_executor_plugin_slurm").is_dir():
        return "the SLURM executor plugin's overlay is missing: run `make slurm-site` (docs/cluster.md)"
    try:
        nodes = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--format=%t"], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return "sinfo timed out: the SLURM controller does not answer"
    usable = [s for s in nodes.stdout.split() if s.rstrip("*") in {"idle", "mix", "alloc"}]
    if nodes.returncode != 0 or not usable:
        return (
            f"no usable SLURM node (sinfo: {(nodes.stdout + nodes.stderr).strip()!r}); run tests/slurm/setup_cluster.sh"
        )
    return None


UNAVAILABLE = _unavailable()
pytestmark = [pytest.mark.slurm, pytest.mark.e2e, pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))]


def snakemake(workdir: Path, *args: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(SLURM_SITE), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([*SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env)


def small_demo(workdir: Path, target: Path) -> Path:
    """The demo config, small: the SLURM wiring, not the drafter's quality, is under test."""
    copy_workflow(workdir)
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    config["target"].update(model=str(target), build_demo=False)  # the suite's, built once
    config["questions"].update(limit=160, heldout=20)
    config["training"]["epochs"] = 3
    # One pass: each generation job saves its answers' states; the extraction jobs adopt
    # them across generation shards and load no target.
    config.setdefault("hidden_states", {})["capture"] = "during_generation"
    # A second kind of drafter from the same data: P-EAGLE, at the demo's short drafts.
    config["training"].update(kinds=["eagle3", "peagle"], kind_args={"peagle": ["--num-depths", "3"]})
    config["evaluation"].update(
        num_speculative_tokens=3, concurrency=8, sampled=False, compare_untrained=False, sets={}
    )
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config))
    return workdir


def slurm_config() -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    return dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", text, re.MULTILINE))


def slurm_records(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """Job id -> {JobState, NodeList, ...} from SLURM's own record of finished jobs."""
    config = slurm_config()
    if config.get("JobCompType") == "jobcomp/filetxt":  # the test cluster: no accounting database
        records = {}
        for line in Path(config["JobCompLoc"]).read_text().splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if fields.get("JobId") in job_ids:
                records[fields["JobId"]] = fields
        return records
    if config.get("AccountingStorageType", "").endswith("slurmdbd"):
        out = subprocess.run(
            ["sacct", "-X", "-P", "--noheader", "-j", ",".join(job_ids), "--format=JobID,State,NodeList,Start,End"],
            capture_output=True,
            text=True,
        ).stdout
        rows = (line.split("|") for line in out.splitlines() if line)
        return {r[0]: {"JobState": r[1], "NodeList": r[2], "StartTime": r[3], "EndTime": r[4]} for r in rows}
    out = subprocess.run(
        ["squeue", "--states=all", "--noheader", "--jobs", ",".join(job_ids), "--format=%i|%T|%N|%S|%e"],
        capture_output=True,
        text=True,
    ).stdout
    rows = (line.split("|") for line in out.splitlines() if line)
    return {r[0]: {"JobState": r[1], "NodeList": r[2], "StartTime": r[3], "EndTime": r[4]} for r in rows}


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory, demo_target):
    """The small demo on SLURM. The workdir lives under the pytest temp dir: on one host that
    is the shared filesystem; on a real cluster point --basetemp at a shared directory."""
    workdir = small_demo(tmp_path_factory.mktemp("slurm_demo"), demo_target)
    started = time.monotonic()
    run = snakemake(workdir, *PROFILE)
    elapsed = time.monotonic() - started
    log = run.stdout + run.stderr
    (workdir / "snakemake_slurm.log").write_text(log)
    assert run.returncode == 0, log[-6000:]
    print(f"\nSLURM demo run: {elapsed:.0f} s in {workdir}")
    return workdir, log


@pytest.fixture(scope="module")
def submitted(slurm_run) -> dict[str, list[tuple[str, str]]]:
    """Rule -> [(wildcards, SLURM job id)] from the plugin's submission lines."""
    workdir, log = slurm_run
    jobs: dict[str, list[tuple[str, str]]] = {}
    for job_id, logfile in SUBMITTED.findall(log):
        parts = Path(logfile).relative_to(workdir / ".snakemake/slurm_logs").parts
        rule, wildcards = parts[0].removeprefix("rule_"), "/".join(parts[1:-1])
        jobs.setdefault(rule, []).append((wildcards, job_id))
        assert (workdir / ".snakemake/slurm_logs" / Path(*parts)).is_file()  # the plugin's log
    return jobs


@pytest.fixture(scope="module")
def local_questions(tmp_path_factory, demo_target) -> Path:
    """The questions stage of the same config, run locally (ids are deterministic)."""
    workdir = small_demo(tmp_path_factory.mktemp("local_questions"), demo_target)
    run = snakemake(workdir, "results/questions/summary.json", "--cores", "1", timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return workdir / "results/questions"


def ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]


def test_every_heavy_job_and_every_shard_was_its_own_slurm_job(submitted):
    table = "\n".join(
        f"  {rule:<18} {w or '-':<10} {job}" for rule, jobs in sorted(submitted.items()) for w, job in jobs
    )
    print(f"\nSLURM jobs (rule, wildcards, job id):\n{table}")
    for rule, shards in SHARDED.items():
        # The plugin's log directory holds the wildcard values: rule_generate/0, rule_generate/1.
        assert sorted(w for w, _ in submitted.get(rule, [])) == [str(i) for i in range(shards)], rule
    for rule in ONE_JOB:
        assert len(submitted.get(rule, [])) == 1, rule
    job_ids = [job for jobs in submitted.values() for _, job in jobs]
    assert len(job_ids) == len(set(job_ids)) == sum(SHARDED.values()) + len(ONE_JOB)
    assert not LOCAL & submitted.keys(), "cheap rules must run on the submit host (localrule: True)"


def test_slurm_recorded_every_shard_job_as_completed(submitted):
    shard_jobs = {job: f"{rule} {w}" for rule in SHARDED for w, job in submitted[rule]}
    records = slurm_records(list(shard_jobs))
    print("\nSLURM's record of the shard jobs:")
    for job, name in shard_jobs.items():
        record = records.get(job, {})
        print(
            f"  {job:>6} {name:<16} {record.get('JobState')} on {record.get('NodeList')} "
            f"{record.get('StartTime')} -> {record.get('EndTime')}"
        )
    assert {job: records.get(job, {}).get("JobState") for job in shard_jobs} == dict.fromkeys(shard_jobs, "COMPLETED")


def test_the_same_questions_as_a_local_run(slurm_run, local_questions):
    workdir, _ = slurm_run
    results = workdir / "results"
    for shard in range(SHARDED["generate"]):
        expected = ids(local_questions / f"shard_{shard}.jsonl")
        assert ids(results / f"questions/shard_{shard}.jsonl") == expected
        answered = ids(results / f"completions/shard_{shard}.jsonl")
        assert sorted(answered) == sorted(expected), f"shard {shard}"
    assert ids(results / "questions/heldout.jsonl") == ids(local_questions / "heldout.jsonl")
    everything = [i for shard in range(SHARDED["generate"]) for i in ids(local_questions / f"shard_{shard}.jsonl")]
    row_ids = RowIds.read(results / "dataset").ids
    assert sorted(row_ids) == sorted(everything)
    # Both extraction shards together hold every row once.
    manifests = [
        json.loads((results / f"hidden_states/shard_{s}/manifest.json").read_text()) for s in range(SHARDED["extract"])
    ]
    assert all(m["vllm_layer_ids"] == [2, 3, 5, 6] for m in manifests)
    assert len(list((results / "hidden_states/all").glob("hs_*.safetensors"))) == len(row_ids)


def test_in_one_pass_each_extraction_job_adopted_rows_of_both_generation_jobs(slurm_run):
    """The generation jobs (two SLURM jobs) saved their answers' states; each extraction job
    found its rows' files in either generation shard's staging and started no server."""
    workdir, _ = slurm_run
    results = workdir / "results"
    for shard in range(SHARDED["extract"]):
        manifest = json.loads((results / f"hidden_states/shard_{shard}/manifest.json").read_text())
        assert manifest["captured_during_generation"] == {"adopted": manifest["num_rows"]}, manifest
        assert "starting vLLM" not in (results / f"logs/extract/shard_{shard}.log").read_text()
    row_ids = RowIds.read(results / "dataset").ids
    by_shard = [set(ids(results / f"completions/shard_{shard}.jsonl")) for shard in range(SHARDED["generate"])]
    first_extraction_shard = row_ids[: len(row_ids) // 2]
    assert all(any(question in shard for question in first_extraction_shard) for shard in by_shard)


def test_the_drafter_was_served_and_drafted(slurm_run):
    """vLLM served the drafter the SLURM job trained, and accepted some of its tokens (the
    acceptance goal itself is test_workflow.py's, on the full demo)."""
    workdir, _ = slurm_run
    result = json.loads((workdir / "results/eval/acceptance.json").read_text())
    print(f"\nacceptance length {result['acceptance_length']:.2f} (3 epochs on {160 - 20} questions)")
    assert result["acceptance_length"] > 1.0, result
    # A drafter of 3 epochs may lose to the target alone: then nothing is served (null).
    chosen = next(
        row
        for row in result["recommendation"]
        if (row["concurrency"], row["temperature"]) == (result["concurrency"], 0.0)
    )
    assert Path(chosen["drafter_speculative_config"]["model"]) == (workdir / "results/drafter").resolve()
    served = json.loads((workdir / "results/drafter_speculative_config.json").read_text())
    assert served == chosen["speculative_config"]


def test_a_second_kind_was_trained_served_and_weighed_against_eagle3(slurm_run):
    """P-EAGLE trained in its own SLURM job from the same rows and states, vLLM's CPU build
    served it (eagle3 method, parallel drafting) and accepted some of its tokens, and the
    recommendation weighed it against EAGLE-3 and the target alone."""
    workdir, _ = slurm_run
    results = workdir / "results"
    config = json.loads((results / "drafter_peagle/config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    measured = json.loads((results / "eval/peagle_k3.json").read_text())
    assert measured["kind"] == "peagle" and measured["method"] == "eagle3"
    result = json.loads((results / "eval/acceptance.json").read_text())
    (row,) = [r for r in result["results"] if (r["method"], r["set"], r["category"]) == ("peagle", "heldout", "*")]
    print(f"\nP-EAGLE acceptance length {row['acceptance_length']:.2f}, {row['tokens_per_s_with_drafter']} tok/s")
    assert row["acceptance_length"] > 1.0, row
    (chosen,) = result["recommendation"]
    assert {"target alone", "drafter k=3", "peagle k=3"} == set(chosen["options"])
    if chosen["serve"] == "peagle k=3":
        assert chosen["speculative_config"]["parallel_drafting"] is True


def test_rerun_has_nothing_to_do(slurm_run):
    workdir, _ = slurm_run
    rerun = snakemake(workdir, *PROFILE, "-n", timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Nothing to be done" in rerun.stdout + rerun.stderr
