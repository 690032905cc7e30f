"""Drafter kinds side by side: every kind that vLLM's CPU build serves, trained from one
finished demo's data with the same epochs, measured by the workflow's own evaluation.

Adds ``training.kinds`` to a finished demo run (by default the one-pass run of
``bench/one_pass.py``) and runs the workflow again: only the new kinds train and are
measured (the feature under test), one heavy job at a time (``--resources gpu=1``) so each
training time is the job alone on the machine. Recorded per kind, from the run's own files:
- training seconds (Snakemake's benchmark file) and the last epoch's validation accuracy;
- acceptance length and tokens/s per set, concurrency and sampling at every draft length;
- what the recommendation serves at each concurrency and sampling, among all kinds.

The demo drafts at most 3 tokens, so the kinds train for that (``KIND_ARGS``): DFlash
blocks of 4 (its default 16 is sized for long drafts) and P-EAGLE 3 depths (default 8).

    python bench/drafter_kinds.py [--run results/bench_one_pass/during_generation.yaml] [--fresh]

``--fresh`` first deletes what the kinds left in the run (drafter, checkpoints, measurements)
and the measurements of EAGLE-3 and the target alone, so the kinds are trained again and all
are measured in the same session; without it a finished run is only read.
"""

import argparse
import shutil
import sys
from pathlib import Path

import yaml
from one_pass import benchmark_seconds
from results_file import RESULTS, run_workflow, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))
from draftsmith.drafter_kinds import DEFAULT_KIND, KINDS  # noqa: E402
from draftsmith.layout import Layout  # noqa: E402
from draftsmith.records import EvaluationSummary, SetResult, TrainingMetrics  # noqa: E402

CPU_KINDS = [kind for kind, spec in KINDS.items() if "cpu" in spec.devices and kind != DEFAULT_KIND]
SERVED_KEYS = ("temperature", "concurrency", "serve", "serve_speedup", "serve_within_noise")
KIND_ARGS = {"dflash": ["--block-size", "4"], "peagle": ["--num-depths", "3"]}


def run_with_kinds(run_config: Path, kinds: list[str]) -> dict:
    config = yaml.safe_load(run_config.read_text())
    config["training"]["kinds"] = [DEFAULT_KIND, *kinds]
    config["training"]["kind_args"] = {kind: KIND_ARGS[kind] for kind in kinds if kind in KIND_ARGS}
    run_workflow(config, run_config.with_name(f"{run_config.stem}.kinds.yaml"), gpus=1)
    return config


def forget(layout: Layout, kinds: list[str], draft_lengths: list[int]) -> None:
    for kind in kinds:
        shutil.rmtree(layout.kind_drafter(kind), ignore_errors=True)
        shutil.rmtree(layout.staging_for(f"train_{kind}"), ignore_errors=True)
        for k in draft_lengths:
            layout.kind_measurement(kind, k).unlink(missing_ok=True)
    # The target alone and EAGLE-3 are measured again too, in the same session as the kinds:
    # throughput on a shared machine moves from one day to the next.
    layout.baseline_measurement.unlink(missing_ok=True)
    for k in draft_lengths:
        layout.drafter_measurement(k).unlink(missing_ok=True)
    # Snakemake re-makes a deleted input only for an output it must make: the summary.
    layout.acceptance.unlink(missing_ok=True)


def kind_result(layout: Layout, kind: str, summary: EvaluationSummary) -> dict:
    drafter = layout.drafter if kind == DEFAULT_KIND else layout.kind_drafter(kind)
    benchmark = "train" if kind == DEFAULT_KIND else f"train_{kind}"
    metrics = TrainingMetrics.read(drafter)
    last = metrics.epochs[-1]["val"] if metrics.epochs else {}
    rows = [r for r in summary.results if isinstance(r, SetResult) and r.method == kind]
    return {
        "training_s": round(benchmark_seconds(layout.results / "benchmarks" / f"{benchmark}.tsv"), 1),
        "validation_accuracy": {name: value for name, value in sorted(last.items()) if "acc" in name},
        "measured": [
            {
                "k": r.num_speculative_tokens,
                "set": r.set,
                "concurrency": r.concurrency,
                "temperature": r.temperature,
                "acceptance_length": r.acceptance_length,
                "tokens_per_s": r.tokens_per_s_with_drafter,
                "speedup": r.speedup,
            }
            for r in rows
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=ROOT / "results/bench_one_pass/during_generation.yaml")
    parser.add_argument("--kinds", nargs="+", default=CPU_KINDS, choices=CPU_KINDS)
    parser.add_argument("--fresh", action="store_true", help="train and measure the kinds again")
    args = parser.parse_args()
    if args.fresh:
        base = yaml.safe_load(args.run.read_text())
        lengths = base["evaluation"]["num_speculative_tokens"]
        forget(Layout(base["results_dir"]), args.kinds, lengths if isinstance(lengths, list) else [lengths])
    config = run_with_kinds(args.run, args.kinds)
    layout = Layout(config["results_dir"])
    summary = EvaluationSummary.read(layout.acceptance)
    kinds = {kind: kind_result(layout, kind, summary) for kind in [DEFAULT_KIND, *args.kinds]}
    write_result(
        "drafter_kinds",
        {
            "run": str(args.run.relative_to(ROOT) if args.run.is_relative_to(ROOT) else args.run),
            "epochs": config["training"]["epochs"],
            "kind_args": config["training"]["kind_args"],
            "kinds": kinds,
            "served": [{key: getattr(row, key) for key in SERVED_KEYS} for row in summary.recommendation],
        },
    )
    print(f"written to {RESULTS / 'drafter_kinds.json'}")


if __name__ == "__main__":
    main()
