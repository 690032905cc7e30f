"""The cost plan for the production example prints on a CPU machine from config.json alone."""

import json
import subprocess
import sys
from pathlib import Path

import yaml
from snakemake.utils import validate

from draftsmith.plan import format_plan, plan_for

ROOT = Path(__file__).resolve().parents[1]
KIMI_TEXT_CONFIG = {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840, "num_attention_heads": 64}


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
    plan = plan_for(kimi_settings(tmp_path, wrapped=True), tmp_path / "results")
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
    rows = [{"id": f"q{i}", "prompt_tokens": 100, "completion_tokens": 400, "finish_reason": "stop"} for i in range(10)]
    (results / "completions" / "shard_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = plan_for(settings, results)
    assert plan["tokens_basis"] == "measured"
    assert plan["training_tokens"] == 500 * plan["questions_train"]
    assert plan["done"]["generation_shards_done"] == 1


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
