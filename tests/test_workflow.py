"""The demo DAG end to end through Snakemake, on a copy of the workflow (the slowest test).

One real run of the shipped demo config (real vLLM CPU build, real speculators), stopped the
way users stop runs in every stage that keeps work in progress (SIGKILL to the whole process
group during question prep, dataset, extraction and training; Ctrl-C during generation) and
resumed each time with the documented command. Then: the resumed run lost and repeated
nothing, the wiring proof (trained drafter vs untrained), nothing left to do on a rerun, the
invalidation matrix (each config key changed alone plans exactly what settings.py says),
each config's own results_dir, no server left behind, the HTML report, and last, re-runs
that reuse finished work (extraction requests nothing again, training resumes).

One run serves all of these: a run per concern cost about 25 minutes more of CI on 2 cores.
"""

import copy
import json
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow, heavy_processes
from interrupt import count, log_says, run_until, staged_answers, uninterrupted_question_ids, unlock
from snakemake.utils import validate

from draftsmith.records import ShardManifest
from draftsmith.settings import reruns_between

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
pytestmark = pytest.mark.e2e


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


@pytest.fixture(scope="module")
def interrupted_demo(tmp_path_factory) -> tuple[Path, Interruptions]:
    workdir = copy_workflow(tmp_path_factory.mktemp("demo"))
    hidden_states = "results/.staging/hidden_states/*/hs_*.safetensors"
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
    run_until(workdir, lambda: count(hidden_states, workdir) >= 70)
    unlock(workdir)
    run_until(workdir, lambda: count(checkpoints, workdir) >= 2)
    unlock(workdir)
    checkpoints_before = count("results/.staging/train/checkpoints/[0-9]*", workdir)

    final = snakemake(workdir, "--cores", "all", "--resources", "gpu=8")
    assert final.returncode == 0, final.stderr[-5000:]
    return workdir, Interruptions(
        answered_before_ctrl_c=answered_before,
        asked_after_ctrl_c=sum(s["asked_this_run"] for s in summaries),
        questions=sum(s["questions"] for s in summaries),
        checkpoints_before_kill=checkpoints_before,
    )


@pytest.fixture(scope="module")
def demo_run(interrupted_demo) -> Path:
    return interrupted_demo[0]


def test_interrupted_anywhere_the_same_commands_finish_without_redoing_work(interrupted_demo, tmp_path):
    workdir, stops = interrupted_demo
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
    row_ids = json.loads((workdir / "results/dataset/row_ids.json").read_text())
    assert sorted(row_ids) == planned
    assert count("results/hidden_states/all/hs_*.safetensors", workdir) == len(row_ids)
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


def test_a_generation_change_replans_generation_and_what_follows(demo_run):
    config = demo_config(demo_run)
    config["generation"]["max_tokens"] = 48
    jobs = dry_run(demo_run, config, "max_tokens")
    assert jobs.get("generate") == config["questions"]["shards"]
    assert {"dataset", "extract", "train", "evaluate"} <= jobs.keys()
    assert "demo_model" not in jobs and "questions" not in jobs


# One change at a time, to every key of the schema, and the hard cases (server options that
# do or do not change numerics, re-sharding): (key, new value).
MATRIX = [
    ("results_dir", "results_elsewhere"),
    ("device", "cuda"),
    ("gpu_slot", 2),
    ("target.model", "results/demo_model_b"),
    ("target.build_demo", False),
    ("target.demo_architecture", "deepseek_v3"),
    ("target.demo_train_steps", 400),
    ("target.trust_remote_code", True),
    ("layers", [1, 3, 4, 5]),
    ("server.tensor_parallel_size", 2),
    ("server.data_parallel_size", 2),
    ("server.max_model_len", 1024),
    ("server.startup_timeout_s", 900),
    ("server.extra_args", ["--enforce-eager", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"]),
    ("server.extra_args", ["--enforce-eager", "--dtype", "float16"]),  # numerics
    ("server.env", {"VLLM_CPU_KVCACHE_SPACE": 2, "HF_HUB_OFFLINE": 1}),
    ("server.env", {"VLLM_CPU_KVCACHE_SPACE": 1, "HF_HUB_OFFLINE": 1, "VLLM_ATTENTION_BACKEND": "X"}),
    ("questions.source", "config/other_questions.jsonl"),
    ("questions.split", "test"),
    ("questions.subset", "other"),
    ("questions.limit", 500),
    ("questions.heldout", 50),
    ("questions.shards", 3),
    ("questions.seed", 1),
    ("generation.concurrency", 4),
    ("generation.max_tokens", 48),
    ("generation.sampling", {"temperature": 0.5, "top_p": 1.0, "seed": 0}),
    ("generation.max_error_fraction", 0.1),
    ("generation.request_timeout_s", 100),
    ("generation.max_retries", 1),
    ("generation.endpoint", {"base_url": "http://127.0.0.1:9/v1"}),
    ("dataset.seq_length", 400),
    ("dataset.min_trainable_tokens", 2),
    ("extraction.shards", 3),
    ("extraction.concurrency", 4),
    ("extraction.request_timeout_s", 100),
    ("extraction.max_retries", 1),
    ("hidden_states.disk_budget", "1 MB"),  # part of the rows stored, the rest captured
    ("hidden_states.disk_budget", 0),  # fully online: no extraction job
    ("hidden_states.stored_dtype", "fp8"),
    ("hidden_states.capture_memory_fraction", 0.6),
    ("training.epochs", 16),
    ("training.lr", 0.001),
    ("training.draft_vocab_size", 150),
    ("training.total_seq_len", 1024),
    ("training.num_layers", 2),
    ("training.seed", 1),
    ("training.stall_timeout_s", 100),
    ("training.extra_args", ["--log-freq", "5"]),
    ("evaluation.num_speculative_tokens", [3, 1, 2]),  # one more draft length
    ("evaluation.num_speculative_tokens", [1, 3]),  # another default: the untrained job's length
    ("evaluation.max_tokens", 32),
    ("evaluation.concurrency", [8, 4, 2]),
    ("evaluation.sampled", False),
    ("evaluation.compare_untrained", False),
    ("evaluation.limit", 10),
    ("evaluation.sets", {"counting": {"source": "config/demo_sets/counting.jsonl", "category_field": "task"}}),
    ("evaluation.request_timeout_s", 100),
    ("evaluation.max_retries", 1),
]


def changed_config(base: dict, key: str, value) -> dict:
    config = copy.deepcopy(base)
    *parents, leaf = key.split(".")
    section = config
    for part in parents:
        section = section.setdefault(part, {})
    section[leaf] = value
    return config


def expected_reruns(base: dict, changed: dict) -> set[str]:
    """What settings.py says the change re-runs (``reruns_between``), on the validated configs."""
    schema = str(ROOT / "workflow/schemas/config.schema.yaml")
    base, changed = copy.deepcopy(base), copy.deepcopy(changed)
    validate(base, schema)
    validate(changed, schema)
    return reruns_between(base, changed)


def test_each_key_changed_alone_plans_exactly_what_the_table_says(demo_run):
    """The invalidation matrix: on the finished demo, `snakemake -n` plans exactly the rules
    settings.py names for each key (no stage runs: planning only)."""
    base = demo_config(demo_run)
    other_source = dict(MATRIX)["questions.source"]
    shutil.copy(demo_run / base["questions"]["source"], demo_run / other_source)
    cases = {f"{key}={json.dumps(value)}": changed_config(base, key, value) for key, value in MATRIX}
    with ThreadPoolExecutor(2) as pool:  # dry runs only read; two at a time on two cores
        jobs = pool.map(lambda item: dry_run(demo_run, item[1], f"matrix_{item[0]}"), enumerate(cases.values()))
        planned = dict(zip(cases, jobs, strict=True))
    wrong = {}
    for case, config in cases.items():
        expected = expected_reruns(base, config)
        if set(planned[case]) != expected:
            wrong[case] = {"planned": sorted(planned[case]), "table": sorted(expected)}
    assert wrong == {}, json.dumps(wrong, indent=1)
    # The scenarios that wasted whole stages before, spelled out. A new draft length is one
    # job (and the summary), the other lengths and the baseline stay.
    assert planned["evaluation.num_speculative_tokens=[3, 1, 2]"] == {
        "evaluate_drafter": 1,
        "evaluate": 1,
        "plan_snapshot": 1,
        "run_metadata": 1,
    }
    assert planned["evaluation.request_timeout_s=100"] == {}
    assert planned["server.startup_timeout_s=900"] == {}
    assert planned["questions.shards=3"]["generate"] == 3


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
    assert table["done: extraction shards / files staged"] == "0 / 0"
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
    """Last (it leaves the evaluation outdated): a forced extraction requests no row again,
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
    assert hidden_state.stat().st_nlink == 2  # the published name and the staged one
    train_log = (results / "logs/train.log").read_text()
    assert "starting afresh" not in train_log and "Starting fresh training run" not in train_log
    assert "Resuming training on epoch" in train_log
    assert checkpoint.stat().st_mtime_ns == checkpoint_written
