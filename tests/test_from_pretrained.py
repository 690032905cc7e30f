"""Starting from a published drafter, end to end on the finished demo: a research EAGLE-3
checkpoint written from the demo's trained drafter is converted, fine-tuned and served, and
measured beside the drafter it became; the re-run plan follows its content; a bad drafter is
refused by the run's preflight before any job; training keeps the drafter's own map, and a
map from other data would cost acceptance.

Drafter A against a drafter from scratch on a second batch of data is a benchmark
(bench/from_pretrained.py): three trained drafters and their evaluations cost minutes that
CI does not have.
"""

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from demo_run import demo_config, dry_run, snakemake
from drafter_layouts import copy_drafter, read_weights, write_research_checkpoint
from safetensors.torch import save_file

from draftsmith.layout import Layout
from draftsmith.records import EvaluationSummary, Measurement, TrainingMetrics

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.training]

FINE_TUNE_EPOCHS = 3
# What starting from a drafter adds to a finished run, and all it re-runs (at the default
# draft length only, to spare CI two server loads; the matrix test plans both lengths).
FINE_TUNING_PLAN = {
    "start_drafter": 1,
    "train": 1,
    "evaluate_start": 1,
    "evaluate_drafter": 1,
    "evaluate": 1,
    "diagnose_gap": 1,
    "training_curves": 1,
    "plan_snapshot": 1,
    "run_metadata": 1,
}


def fine_tune_config(workdir: Path, drafter: Path) -> dict:
    config = demo_config(workdir)
    config["training"] |= {"from_pretrained": str(drafter), "epochs": FINE_TUNE_EPOCHS}
    config["evaluation"]["num_speculative_tokens"] = config["evaluation"]["num_speculative_tokens"][:1]
    return config


@pytest.fixture(scope="module")
def fine_tuned(demo_run, tmp_path_factory) -> tuple[Path, Path]:
    """A copy of the finished demo, fine-tuned from its own drafter in the research layout."""
    base = tmp_path_factory.mktemp("from_pretrained")
    workdir = shutil.copytree(demo_run, base / "demo", symlinks=True)
    research = write_research_checkpoint(workdir / "results/drafter", base / "published" / "research")
    config = fine_tune_config(workdir, research)
    assert dry_run(workdir, config, "from_pretrained") == FINE_TUNING_PLAN
    run = snakemake(workdir, "--cores", "all", "--resources", "gpu=8", "--configfile", "config/from_pretrained.yaml")
    assert run.returncode == 0, run.stderr[-5000:]
    return workdir, research


def test_a_research_checkpoint_is_converted_fine_tuned_and_served_beside_the_result(fine_tuned):
    workdir, research = fine_tuned
    layout = Layout(workdir / "results")
    summary = EvaluationSummary.from_json(layout.acceptance.read_text())
    # The published drafter, before the run's data, is one more method on the same sets and lengths.
    starts = {(row.num_speculative_tokens, row.set) for row in summary.results if row.method == "start"}
    drafters = {(row.num_speculative_tokens, row.set) for row in summary.results if row.method == "eagle3"}
    assert starts == drafters
    assert summary.start_acceptance_length is not None
    # It was trained on this data already: converted faithfully, it drafts far better than chance.
    assert summary.start_acceptance_length > summary.untrained_acceptance_length + 1.0
    assert all(any(name.startswith("start k=") for name in row.options) for row in summary.recommendation)
    assert "start" in layout.evaluation_tables.read_text()
    metrics = TrainingMetrics.read(layout.training_metrics)
    assert len(metrics.epochs) == FINE_TUNE_EPOCHS
    assert "research EAGLE-3" in metrics.started_from and str(research) in metrics.started_from
    # Fine-tuning continued from it: the first epoch validates like a trained drafter, not a new one.
    assert metrics.epochs[0]["val"]["full_acc_0"] > 0.7


def test_training_keeps_the_drafters_own_vocabulary_map(fine_tuned):
    workdir, _ = fine_tuned
    start = read_weights(workdir / "results/start_drafter")
    tuned = read_weights(workdir / "results/drafter")
    assert (tuned["d2t"] == start["d2t"]).all() and (tuned["t2d"] == start["t2d"]).all()
    assert not (tuned["fc.weight"] == start["fc.weight"]).all()  # and it did train


def test_a_copy_elsewhere_plans_nothing_and_one_changed_byte_plans_training(fine_tuned, tmp_path):
    workdir, research = fine_tuned
    copy = shutil.copytree(research, tmp_path / "moved" / "drafter")  # new path, new mtimes
    assert dry_run(workdir, fine_tune_config(workdir, copy), "moved") == {}
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # the last byte of the last tensor's data
    (copy / "model.safetensors").write_bytes(bytes(weights))
    assert dry_run(workdir, fine_tune_config(workdir, copy), "changed") == FINE_TUNING_PLAN


def digest(path: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())).hexdigest()


def test_the_run_refuses_a_drafter_of_other_layers_before_any_job(fine_tuned, tmp_path):
    workdir, _ = fine_tuned
    shifted = copy_drafter(
        workdir / "results/start_drafter", tmp_path / "shifted", eagle_aux_hidden_state_layer_ids=[2, 4, 5]
    )
    before = digest(workdir / "results/drafter")
    config_path = workdir / "config" / "shifted.yaml"
    config_path.write_text(yaml.safe_dump(fine_tune_config(workdir, shifted)))
    started = time.monotonic()
    run = snakemake(workdir, "--cores", "all", "--resources", "gpu=8", "--configfile", str(config_path), timeout=600)
    assert run.returncode != 0
    assert (
        f"training.from_pretrained: the drafter at {shifted} reads vLLM layers 2, 4, 5 (its "
        "eagle_aux_hidden_state_layer_ids), the config's layers [1, 2, 4, 5] give 2, 3, 5; set layers: [1, 3, 4, 5]"
    ) in run.stderr
    assert "nothing was started" in run.stderr
    assert digest(workdir / "results/drafter") == before
    print(f"refused in {time.monotonic() - started:.1f} s")


def test_a_map_recomputed_from_other_data_would_cost_acceptance(fine_tuned, tmp_path):
    """What training would do if it rebuilt the map from the new data's token frequencies
    (speculators' own builder) where they rank a few tokens differently: the output head's
    learnt rows would point at other tokens. Served, acceptance falls."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    workdir, _ = fine_tuned
    start = workdir / "results/start_drafter"
    weights = read_weights(start)
    frequencies = dict(torch.load(workdir / "results/dataset/token_freq.pt"))
    common = sorted(frequencies, key=lambda token: -frequencies[token])[:10]
    other_data = {token: (0 if token in common else count) for token, count in frequencies.items()}
    d2t, t2d = build_vocab_mappings_from_distribution(other_data, len(weights["d2t"]), len(weights["t2d"]))
    assert not (d2t == weights["d2t"]).all()
    recomputed = copy_drafter(start, tmp_path / "recomputed")
    save_file(weights | {"d2t": d2t, "t2d": t2d}, str(recomputed / "model.safetensors"), metadata={"format": "pt"})
    np.save(recomputed / "d2t.npy", d2t.numpy())
    output = tmp_path / "recomputed_k3.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftsmith.evaluate",
            "--settings",
            str(workdir / "results/.staging/config.json"),
            "--stage",
            "evaluate_start",
            "--default-only",
            "--start",
            "--prompts",
            str(workdir / "results/eval/prompts.jsonl"),
            "--drafter",
            str(recomputed),
            "--num-speculative-tokens",
            "3",
            "--output",
            str(output),
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = EvaluationSummary.from_json((workdir / "results/eval/acceptance.json").read_text())
    recomputed_length = _heldout_acceptance(Measurement.read(output))
    print(f"held-out acceptance: own map {summary.start_acceptance_length}, recomputed {recomputed_length:.3f}")
    assert recomputed_length < summary.start_acceptance_length - 0.5


def _heldout_acceptance(job: Measurement) -> float:
    from draftsmith.records import acceptance_length, merged

    phase = next(p for p in job.phases if p.set == "heldout" and p.temperature == 0.0)
    return acceptance_length(merged(phase.categories.values()))


def test_the_plan_names_the_starting_drafter(fine_tuned):
    workdir, research = fine_tuned
    plan = json.loads((workdir / "results/plan.json").read_text())
    assert plan["starting_drafter"]["source"] == str(research)
