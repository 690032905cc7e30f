"""The demo DAG end to end through Snakemake, on a copy of the workflow (the slowest test).

On the interrupted and resumed demo run (tests/demo_run.py, in one pass): the resumed run lost
and repeated nothing, each answer's states captured once, the wiring proof (trained drafter vs
untrained), nothing left to do on a rerun, each config's own results_dir, no server left
behind, the HTML report, and last, re-runs that reuse finished work (extraction requests
nothing again, training resumes). The invalidation matrix on the same run is
test_rerun_matrix.py.
"""

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml
from conftest import heavy_processes
from demo_run import demo_config, planned_jobs, snakemake
from interrupt import count, run_until, uninterrupted_question_ids, unlock

from draftsmith import serve
from draftsmith.layout import Layout
from draftsmith.one_pass import ADOPTED
from draftsmith.records import RowIds, ShardManifest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def test_interrupted_anywhere_the_same_commands_finish_without_redoing_work(interrupted_demo, tmp_path):
    workdir, stops = interrupted_demo
    assert not isinstance(stops, str), stops
    assert heavy_processes() == []
    # After Ctrl-C the same command asked only for the questions not answered.
    assert stops.answered_before_ctrl_c >= 60
    assert stops.asked_after_ctrl_c == stops.questions - stops.answered_before_ctrl_c
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
    row_ids = RowIds.read(workdir / "results/dataset").ids
    assert sorted(row_ids) == planned
    assert count("results/hidden_states/all/hs_*.safetensors", workdir) == len(row_ids)
    # One pass, across the Ctrl-C: each answer's states were captured once, and the extraction
    # adopted every row without loading the target.
    assert count("results/.staging/completions/*/captures/*.safetensors", workdir) == len(planned)
    for shard in sorted(workdir.glob("results/hidden_states/shard_*")):
        manifest = ShardManifest.read(shard)
        assert manifest is not None and manifest.captured_during_generation == {ADOPTED: manifest.num_rows}
    for log in sorted(workdir.glob("results/logs/extract/shard_*.log")):
        assert "starting vLLM" not in log.read_text()
    # Training resumed from its checkpoints instead of starting over.
    assert stops.checkpoints_before_kill >= 2
    assert "Resuming training on epoch" in (workdir / "results/logs/train.log").read_text()


def test_demo_reaches_the_acceptance_goal_and_beats_an_untrained_drafter(demo_run):
    result = json.loads((demo_run / "results/eval/acceptance.json").read_text())
    for key in (
        "acceptance_length",
        "acceptance_per_position",
        "tokens_per_s_with_drafter",
        "tokens_per_s_without_drafter",
    ):
        assert key in result
    assert len(result["acceptance_per_position"]) == 3
    assert result["acceptance_length"] >= 2.5, result
    assert result["acceptance_length"] > result["untrained_acceptance_length"] + 1.0, result
    assert (demo_run / "results/eval/acceptance.png").stat().st_size > 10_000


def test_the_sweep_measures_every_set_category_draft_length_concurrency_and_sampling(demo_run):
    result = json.loads((demo_run / "results/eval/acceptance.json").read_text())
    rows = result["results"]
    print(json.dumps(result["recommendation"], indent=1))
    assert {(r["set"], r["category"]) for r in rows} >= {
        ("heldout", "*"),
        ("counting", "*"),
        ("counting", "count_up"),
        ("counting", "count_down"),
        ("counting", "count_by"),
        ("words", "spell"),
        ("words", "repeat"),
    }
    assert {(r["num_speculative_tokens"], r["concurrency"], r["temperature"]) for r in rows} == {
        (k, c, t) for k in (3, 1) for c in (8, 4) for t in (0.0, 0.7)
    }
    assert all(len(r["acceptance_per_position"]) == r["num_speculative_tokens"] for r in rows)
    # The table's choice at the first concurrency, greedy, is the serving config.
    assert {(r["concurrency"], r["temperature"]) for r in result["recommendation"]} == {
        (8, 0.0),
        (4, 0.0),
        (8, 0.7),
        (4, 0.7),
    }
    # Every throughput carries its spread; the choice is among the draft lengths within noise
    # of the fastest, which include it.
    for row in result["recommendation"]:
        assert all(spread > 0 for spread in row["spread_by_draft_length"].values()), row
        fastest = max(row["tokens_per_s_by_draft_length"], key=row["tokens_per_s_by_draft_length"].get)
        assert int(fastest) in row["within_noise"] and row["num_speculative_tokens"] in row["within_noise"], row
    chosen = next(r for r in result["recommendation"] if (r["concurrency"], r["temperature"]) == (8, 0.0))
    served = json.loads((demo_run / "results/drafter_speculative_config.json").read_text())
    assert served == chosen["speculative_config"]
    # Sampled at the generation's temperature the drafter still drafts well: vLLM's CPU build
    # without draftsmith's sampling plugin accepts almost nothing there (1.0).
    sampled = next(
        r
        for r in rows
        if (r["set"], r["category"], r["num_speculative_tokens"], r["concurrency"], r["temperature"])
        == ("heldout", "*", 3, 8, 0.7)
    )
    assert sampled["acceptance_length"] >= 2.0, sampled
    assert (demo_run / "results/eval/speedup.png").stat().st_size > 10_000


def test_drafter_carries_the_extracted_layers(demo_run):
    drafter = json.loads((demo_run / "results/drafter/config.json").read_text())
    manifest = ShardManifest.read(demo_run / "results/hidden_states/shard_0")
    # Outputs of layers 1, 2, 4 (+ the final 5) are vLLM ids 2, 3, 5 (+ 6).
    assert manifest is not None and manifest.vllm_layer_ids == [2, 3, 5, 6]
    assert drafter["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    # The drafter's serving config (what is served may be another option: the sweep test).
    result = json.loads((demo_run / "results/eval/acceptance.json").read_text())
    for row in result["recommendation"]:
        spec = row["drafter_speculative_config"]
        assert spec["method"] == "eagle3" and Path(spec["model"]) == (demo_run / "results/drafter").resolve()


def test_every_question_is_answered_once_and_traceable(demo_run):
    summary = json.loads((demo_run / "results/questions/summary.json").read_text())
    answered = [
        json.loads(line)["id"]
        for shard in sorted((demo_run / "results/completions").glob("shard_*.jsonl"))
        for line in shard.read_text().splitlines()
    ]
    assert len(answered) == len(set(answered)) == summary["train"]
    row_ids = RowIds.read(demo_run / "results/dataset").ids
    assert sorted(row_ids) == sorted(answered)
    links = list((demo_run / "results/hidden_states/all").glob("hs_*.safetensors"))
    assert len(links) == len(row_ids) and all(link.is_symlink() for link in links)


def test_second_run_has_nothing_to_do_and_no_server_is_left(demo_run):
    assert heavy_processes() == []
    rerun = snakemake(demo_run, "-n")
    assert rerun.returncode == 0
    assert "Nothing to be done" in rerun.stdout + rerun.stderr


def test_the_production_plan_shows_only_its_own_results_dir(demo_run):
    """Planning Kimi next to a finished demo: nothing done, the upper-bound estimate."""
    kimi = yaml.safe_load((demo_run / "config/kimi-k2.5-int4.yaml").read_text())
    target = demo_run / "kimi-config-only"
    target.mkdir()
    shutil.copy(ROOT / "tests/data/kimi-k2.5-config.json", target / "config.json")
    kimi["target"]["model"] = str(target)
    path = demo_run / "config" / "kimi-here.yaml"
    path.write_text(yaml.safe_dump(kimi))
    run = snakemake(demo_run, "plan", "--cores", "1", "--configfile", str(path), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    table = dict(line.split("  ", 1) for line in run.stdout.splitlines() if "  " in line)
    table = {name.strip(): value.strip() for name, value in table.items()}
    assert table["hidden states"].startswith("4.2 TiB")
    assert table["questions (train / held out)"].startswith("9,800 / 200 (config")
    assert table["done: generation shards / answers staged"] == "0 / 0"
    assert table["done: extraction shards / files staged / captured in one pass"] == "0 / 0 / 0"
    assert table["done: drafter / evaluation"] == "no / no"
    assert (demo_run / "results/kimi-k2.5-int4/logs/plan.log").is_file()


def test_a_missing_question_file_fails_in_seconds_naming_it(demo_run):
    config = demo_config(demo_run)
    config["questions"]["source"] = "config/nope.jsonl"
    path = demo_run / "config" / "nope.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.monotonic()
    run = snakemake(demo_run, "--cores", "all", "--resources", "gpu=8", "--configfile", str(path))
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "questions.source config/nope.jsonl does not exist (a local path, not a hub id)" in output
    assert "Nothing to be done" not in output
    print(f"refused in {time.monotonic() - started:.1f}s")


def test_report_holds_the_plots(demo_run):
    report = demo_run / "report.html"
    run = snakemake(demo_run, "--report", str(report))
    assert run.returncode == 0, run.stderr[-3000:]
    html = report.read_text(errors="replace")
    assert report.stat().st_size > 50_000
    for expected in ("acceptance.png", "speedup.png", "tables.html", "plan.txt"):
        assert expected in html


def test_every_heavy_job_leaves_a_benchmark_record(demo_run):
    """Snakemake's benchmark: wall and CPU seconds and peak memory of each server or trainer job."""
    records = sorted(
        str(p.relative_to(demo_run / "results/benchmarks")) for p in demo_run.glob("results/benchmarks/**/*.tsv")
    )
    assert records == [
        "demo_model.tsv",
        "evaluate/baseline.tsv",
        "evaluate/drafter_k1.tsv",
        "evaluate/drafter_k3.tsv",
        "evaluate/untrained_k3.tsv",
        "extract/shard_0.tsv",
        "extract/shard_1.tsv",
        "generate/shard_0.tsv",
        "generate/shard_1.tsv",
        "train.tsv",
        "untrained_drafter.tsv",
    ]
    header, values = (demo_run / "results/benchmarks/train.tsv").read_text().splitlines()[:2]
    assert header.split("\t")[:3] == ["s", "h:m:s", "max_rss"] and float(values.split("\t")[0]) > 0


def test_forced_reruns_reuse_finished_work(demo_run):
    """Next to last (it leaves the evaluation outdated): a forced extraction requests no row again,
    since the published files are links to the staged ones, and training, fed the same
    data republished, resumes from its checkpoints instead of starting over."""
    results = demo_run / "results"
    checkpoint = next((results / ".staging/train/checkpoints").glob("[0-9]*/model.safetensors"))
    checkpoint_written = checkpoint.stat().st_mtime_ns
    run = snakemake(demo_run, "--forcerun", "extract", "--until", "train", "--cores", "all", "--resources", "gpu=8")
    assert run.returncode == 0, run.stderr[-5000:]
    for log in sorted((results / "logs/extract").glob("shard_*.log")):
        text = log.read_text()
        assert ", 0 to request" in text, text[-2000:]
        assert "starting vLLM" not in text
    hidden_state = next((results / "hidden_states/shard_0").glob("hs_*.safetensors"))
    # The published name, the staged one and the file the generation server captured.
    assert hidden_state.stat().st_nlink == 3
    train_log = (results / "logs/train.log").read_text()
    assert "starting afresh" not in train_log and "Starting fresh training run" not in train_log
    assert "Resuming training on epoch" in train_log
    assert checkpoint.stat().st_mtime_ns == checkpoint_written


def test_a_killed_forced_training_leaves_a_plan_that_rebuilds_the_drafter(demo_run):
    """Last. Snakemake deletes a forced job's output when the job starts, so a forced training
    killed half way leaves no drafter; a plain rerun must plan to rebuild it (it once said
    "Nothing to be done", the evaluation being up to date) and serve must refuse at once."""
    results = Layout(demo_run / "results")
    run_until(demo_run, lambda: not results.drafter.exists(), options=("--forcerun", "train"))
    unlock(demo_run)
    with pytest.raises(serve.ServeError, match="missing or incomplete.*rerun the workflow"):
        serve.speculative_config(results, None, drafter=True)
    plan = snakemake(demo_run, "-n")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert planned_jobs(plan.stdout).get("train") == 1, plan.stdout[-3000:]
    rebuilt = snakemake(demo_run, "--until", "train", "--cores", "all", "--resources", "gpu=8")
    assert rebuilt.returncode == 0, rebuilt.stderr[-5000:]
    assert serve.speculative_config(results, None, drafter=True)["model"]
