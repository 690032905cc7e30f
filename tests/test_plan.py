"""The cost plan for the production example prints on a CPU machine from config.json alone."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import generation_line
from snakemake.utils import validate

from draftsmith import run_costs
from draftsmith.disk_budget import StoredRowFormat, parse_budget
from draftsmith.plan import format_plan
from draftsmith.run_config import RunConfig
from draftsmith.run_costs import plan_for

ROOT = Path(__file__).resolve().parents[1]
KIMI_TEXT_CONFIG = {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840, "num_attention_heads": 64}
KIMI_ROW = StoredRowFormat(4, 7168, "bfloat16")  # its 4 stored layers, served in bf16


def kimi_settings(tmp_path, wrapped=False):
    config = yaml.safe_load((ROOT / "config" / "kimi-k2.5-int4.yaml").read_text())
    validate(config, str(ROOT / "workflow/schemas/config.schema.yaml"))
    model = tmp_path / "Kimi-K2.5-INT4"
    model.mkdir()
    # Kimi-K2.5 is multimodal: its language model's config sits under text_config.
    body = {"model_type": "kimi_k25", "text_config": KIMI_TEXT_CONFIG} if wrapped else KIMI_TEXT_CONFIG
    (model / "config.json").write_text(json.dumps(body))
    config["target"]["model"] = str(model)
    return config


def test_kimi_plan_bytes_are_tokens_times_layers_times_hidden_times_two(tmp_path):
    plan = plan_for(RunConfig.from_dict(kimi_settings(tmp_path, wrapped=True)), tmp_path / "results")
    assert plan["questions_train"] == 10000 - 200
    assert plan["stored_layers"] == 4 and plan["hidden_size"] == 7168
    assert plan["hidden_state_bytes"] == plan["training_tokens"] * 4 * 7168 * 2
    assert plan["training_tokens"] <= plan["questions_train"] * 8192
    # The evaluation sweeps 4 draft lengths: the target alone once, then once per length.
    assert plan["model_loads"] == {"generation": 1, "extraction": 1, "evaluation": 5}
    assert "5 (evaluation: target alone + 4 draft length(s))" in format_plan(plan)
    assert plan["gpus_per_server"] == 8


def test_measured_tokens_replace_the_upper_bound(tmp_path):
    settings = kimi_settings(tmp_path)
    results = tmp_path / "results"
    (results / "completions").mkdir(parents=True)
    rows = [generation_line(f"q{i}", prompt_tokens=100, completion_tokens=400) for i in range(10)]
    (results / "completions" / "shard_0.jsonl").write_text("".join(rows))
    plan = plan_for(RunConfig.from_dict(settings), results)
    assert plan["tokens_basis"] == "measured"
    assert plan["training_tokens"] == 500 * plan["questions_train"]
    assert plan["done"]["generation_shards_done"] == 1


def test_after_the_questions_stage_the_plan_counts_its_questions_and_the_prompts_it_dropped(tmp_path):
    results = tmp_path / "results"
    (results / "questions").mkdir(parents=True)
    summary = {"train": 9000, "heldout": 200, "too_long": 45, "max_prompt_tokens": 1408}
    (results / "questions" / "summary.json").write_text(json.dumps(summary))
    plan = plan_for(RunConfig.from_dict(kimi_settings(tmp_path)), results)
    assert (plan["questions_train"], plan["questions_heldout"]) == (9000, 200)
    assert "9,000 / 200 (questions stage; 45 dropped: prompt over 1,408 tokens)" in format_plan(plan)


def test_the_plan_counts_turns_and_tokens_per_turn(tmp_path):
    """Multi-turn conversations: the questions stage's turns before generation (every answer
    at max_tokens), the answered turns after it; a row is a whole conversation."""
    results = tmp_path / "results"
    (results / "questions").mkdir(parents=True)
    summary = {"train": 1000, "train_turns": 3000, "heldout": 200, "too_long": 0, "max_prompt_tokens": 1408}
    (results / "questions" / "summary.json").write_text(json.dumps(summary))
    settings = kimi_settings(tmp_path)
    plan = plan_for(RunConfig.from_dict(settings), results)
    max_tokens = settings["generation"]["max_tokens"]
    assert (plan["turns_train"], plan["completion_tokens"]) == (3000, 3000 * max_tokens)
    assert plan["completion_tokens_per_turn"] == max_tokens and plan["tokens_basis"] == "upper bound"
    assert "turns (train): per conversation" in format_plan(plan) and "3,000: 3.0" in format_plan(plan)

    (results / "completions").mkdir()
    rows = [generation_line(f"q{i}", prompt_tokens=300, completion_tokens=600, turns=2) for i in range(10)]
    (results / "completions" / "shard_0.jsonl").write_text("".join(rows))
    plan = plan_for(RunConfig.from_dict(settings), results)
    assert (plan["turns_train"], plan["prompt_tokens_per_turn"], plan["completion_tokens_per_turn"]) == (2000, 150, 300)
    assert plan["training_tokens"] == 900 * 1000
    assert "150 / 300 (measured)" in format_plan(plan)


def test_plan_cli_prints_the_table(tmp_path):
    settings = kimi_settings(tmp_path)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftsmith.plan",
            "--settings",
            json.dumps(settings),
            "--results",
            str(tmp_path / "results"),
            "--output",
            str(tmp_path / "plan.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "hidden states" in run.stdout and "TiB" in run.stdout and "x 7168 x 2 B" in run.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["stored_layers"] == 4
    assert "x 7168 x 2 B" in (tmp_path / "plan.txt").read_text()


def test_snakemake_plans_every_stage_of_the_production_config_without_gpus(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", "config/kimi-k2.5-int4.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for rule in ("questions", "generate", "dataset", "extract", "training_view", "train", "evaluate_baseline"):
        assert f"rule {rule}:" in run.stdout
    # One drafter job per draft length of the sweep, and the public prompt sets.
    assert run.stdout.count("rule evaluate_drafter:") == 4
    assert "rule evaluate:" in run.stdout and "rule evaluation_sets:" in run.stdout
    assert "demo_model" not in run.stdout


def modes_by_name(plan):
    return {mode["mode"]: mode for mode in plan["storage_modes"]}


def test_kimi_at_600k_questions_plans_offline_a_budget_that_fits_and_online(tmp_path, monkeypatch):
    settings = kimi_settings(tmp_path, wrapped=True)
    settings["questions"]["limit"] = 600_000
    free = 20 * 2**40  # 20 TiB free under results_dir
    monkeypatch.setattr(run_costs.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, free))
    plan = plan_for(RunConfig.from_dict(settings), tmp_path / "results")
    modes = modes_by_name(plan)
    rows, epochs = plan["questions_train"], settings["training"]["epochs"]
    assert modes["offline"]["stored_bytes"] > 100 * 10**12  # hundreds of TB
    assert modes["offline"]["capture_passes"] == 0 and modes["offline"]["model_loads"] == 1
    fits = modes["budget that fits"]
    assert fits["peak_disk_bytes"] <= free * run_costs.FREE_DISK_SHARE < modes["offline"]["peak_disk_bytes"]
    assert 0 < fits["rows_stored"] < rows
    assert fits["capture_passes"] == (rows - fits["rows_stored"]) * epochs and fits["model_loads"] == 2
    online = modes["online"]
    assert online["stored_bytes"] == 0 and online["capture_passes"] == rows * epochs and online["model_loads"] == 1
    # Captured files in flight: one per dataloader worker (4) of each of the 8 trainers.
    assert online["peak_disk_bytes"] == 8 * 4 * KIMI_ROW.row_bytes(8192)
    table = format_plan(plan)
    suggested = re.search(r'set hidden_states.disk_budget: "([^"]+)"', table).group(1)
    assert parse_budget(suggested) <= free * run_costs.FREE_DISK_SHARE


@pytest.mark.parametrize("stored_dtype", ["served", "fp8"])
def test_a_configured_budget_is_planned_beside_offline_and_online(tmp_path, stored_dtype):
    settings = kimi_settings(tmp_path)
    each = dataclasses.replace(KIMI_ROW, fp8=stored_dtype == "fp8").row_bytes(8192)
    settings["hidden_states"] |= {"disk_budget": 1000 * each, "stored_dtype": stored_dtype}
    modes = modes_by_name(plan_for(RunConfig.from_dict(settings), tmp_path / "results"))
    assert modes["budget (configured)"]["rows_stored"] == 1000
    assert modes["budget (configured)"]["stored_bytes"] == 1000 * each
    separate = [name for name in modes if not name.startswith("one pass")]
    assert separate[0] == "offline" and separate[-1] == "online"


def test_fp8_storage_plans_about_half_the_bytes_with_its_scales(tmp_path):
    settings = kimi_settings(tmp_path)
    served = plan_for(RunConfig.from_dict(settings), tmp_path / "results")
    settings["hidden_states"] |= {"disk_budget": "all", "stored_dtype": "fp8"}
    fp8 = plan_for(RunConfig.from_dict(settings), tmp_path / "results")
    tokens = fp8["training_tokens"]
    assert fp8["hidden_state_bytes"] == tokens * (4 * 7168 + 4) == served["hidden_state_bytes"] // 2 + tokens * 4
    assert "x 1 B (fp8) + 4 B scale" in format_plan(fp8)


def test_a_target_served_in_fp32_stores_four_bytes_a_value(tmp_path):
    """vLLM writes hidden states in the dtype it serves: --dtype float32 (the CPU configs'
    choice without native bf16) doubles the bytes the plan and the disk budget count."""
    settings = kimi_settings(tmp_path)
    bf16 = plan_for(RunConfig.from_dict(settings), tmp_path / "results")
    settings["server"]["extra_args"] = ["--dtype", "float32"]
    fp32 = plan_for(RunConfig.from_dict(settings), tmp_path / "results")
    assert fp32["hidden_state_bytes"] == 2 * bf16["hidden_state_bytes"] == fp32["training_tokens"] * 4 * 7168 * 4
    assert "tokens x 4 layers x 7168 x 4 B" in format_plan(fp32)
    settings["server"]["extra_args"] = ["--dtype=bfloat16"]
    assert plan_for(RunConfig.from_dict(settings), tmp_path / "results")["bytes_per_value"] == 2


def test_the_plan_in_hours_shows_what_one_pass_saves_and_that_online_recaptures_every_epoch(tmp_path):
    """Kimi at 600,000 questions on one 8xH200 host: every storage mode in loads, tokens
    through the target and the trainer, and hours, from rates that name their source."""
    settings = kimi_settings(tmp_path)
    shutil.copy(ROOT / "tests/data/kimi-k2.5-config.json", Path(settings["target"]["model"]) / "config.json")
    settings["questions"]["limit"] = 600_000
    plan = plan_for(RunConfig.from_dict(settings), tmp_path / "results")
    assert 31e9 < plan["active_parameters"] < 33e9  # Kimi-K2.5: 32B active of ~1T
    timed = {mode["mode"]: mode for mode in plan["timed_modes"]}
    offline, one_pass, online = timed["offline"], timed["one pass, offline"], timed["online"]
    epochs, rows = settings["training"]["epochs"], plan["training_tokens"]
    assert online["recapture_tokens"] == epochs * rows and online["prefill_tokens"] == 0  # every row, every epoch
    assert offline["prefill_tokens"] == rows and one_pass["prefill_tokens"] == 0
    assert one_pass["model_loads"] == offline["model_loads"] - 1  # no extraction load
    rates = plan["rates"]
    saved_s = rows / rates["prefill_tokens_per_s"]["value"] + rates["load_s"]["value"]
    assert offline["hours"] - one_pass["hours"] == pytest.approx(saved_s / 3600, abs=0.02)
    assert online["hours"] > offline["hours"] > one_pass["hours"]
    assert one_pass["gpu_hours"] == pytest.approx(one_pass["hours"] * 8, rel=0.01)
    assert all(rate["source"] for rate in rates.values())
    table = format_plan(plan)
    assert "one pass, offline" in table and "rate: prefill" in table
    print(table)


def test_a_finished_run_measures_its_own_rates(tmp_path):
    """Once generation has run, its tokens over its benchmarked seconds (less the load its
    log reports) replace the table's decode figure, and the load time is the run's own."""
    settings = kimi_settings(tmp_path)
    results = tmp_path / "results"
    (results / "completions").mkdir(parents=True)
    rows = [generation_line(f"q{i}", prompt_tokens=100, completion_tokens=400) for i in range(10)]
    (results / "completions" / "shard_0.jsonl").write_text("".join(rows))
    (results / "benchmarks/generate").mkdir(parents=True)
    (results / "benchmarks/generate/shard_0.tsv").write_text("s\th:m:s\n140.0\t0:02:20\n")
    (results / "logs/generate").mkdir(parents=True)
    (results / "logs/generate/shard_0.log").write_text("[t] server ready at http://127.0.0.1:1/v1 after 40s\n")
    rates = plan_for(RunConfig.from_dict(settings), results)["rates"]
    assert rates["decode_tokens_per_s"] == {"value": 40.0, "source": "measured: this run's generation"}
    assert rates["load_s"]["value"] == 40.0 and rates["load_s"]["source"].startswith("measured")
    assert not rates["prefill_tokens_per_s"]["source"].startswith("measured")  # no extraction yet
