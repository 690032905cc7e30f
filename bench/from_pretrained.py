"""Starting from a published drafter, on the demo: what a second batch of data buys.

The demo's questions are split once (seed 0) into a shared held-out set of 60 and two
halves. Three kinds of run, each a plain Snakemake run of ``config/config.yaml`` changed only
where said:

- ``start``: drafter A, trained from scratch on the first half (the demo's 15 epochs and
  learning rate) in its own results directory;
- ``scratch``: a drafter trained from scratch on the second half for ``--epochs`` epochs;
- ``fine_tuned``: drafter A fine-tuned on the second half (``training.from_pretrained`` at A's
  published drafter) for the same epochs, once per learning rate of ``--lrs``. These runs
  share the second half's results directory with ``scratch``, so they re-run only the
  starting drafter, training and the evaluation (the plan that proves re-run precision).

Every run is evaluated on the shared held-out set (greedy, k=3, concurrency 8); the
fine-tuned runs also measure A itself as the method ``start``. Recorded: each drafter's
held-out acceptance length and per-position acceptance, its last epoch's validation
``full_acc_i``, and the training job's seconds. ``fine_tuned`` is the run at the learning rate
the bench finds best, which is the default of ``training.fine_tune_lr``.

    python bench/from_pretrained.py [--work results/bench_from_pretrained] [--epochs 5]
        [--lrs 0.003 0.001 0.0003]
"""

import argparse
import csv
import json
import random
import sys
from pathlib import Path

import yaml
from results_file import run_workflow, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))
from draftsmith.layout import Layout  # noqa: E402
from draftsmith.records import EvaluationSummary, TrainingMetrics  # noqa: E402

CONFIG = ROOT / "config/config.yaml"
QUESTIONS = ROOT / "config/demo_questions.jsonl"
HELDOUT = 60
SHARED = "shared_heldout"  # the evaluation set every run is measured on


def split_questions(work: Path) -> dict[str, Path]:
    lines = QUESTIONS.read_text().splitlines()
    random.Random(0).shuffle(lines)
    rest = lines[HELDOUT:]
    parts = {"heldout": lines[:HELDOUT], "first_half": rest[: len(rest) // 2], "second_half": rest[len(rest) // 2 :]}
    paths = {}
    for name, part in parts.items():
        paths[name] = work / f"{name}.jsonl"
        paths[name].write_text("\n".join(part) + "\n")
    return paths


def run_config(base: dict, work: Path, results: str, questions: Path, heldout: Path, **training) -> dict:
    config = json.loads(json.dumps(base))
    config["results_dir"] = str(work / results)
    config["target"] |= {"model": str(work / "target"), "build_demo": results == "a"}
    config["questions"] |= {"source": str(questions), "heldout": 1}
    config["training"] |= training
    config["evaluation"] |= {
        "num_speculative_tokens": [3],
        "concurrency": [8],
        "sampled": False,
        "compare_untrained": False,
        "sets": {SHARED: {"source": str(heldout)}},
    }
    return config


def snakemake(config: dict, name: str, work: Path) -> None:
    run_workflow(config, work / f"{name}.yaml")


def held_out(layout: Layout, method: str) -> dict:
    summary = EvaluationSummary.from_json(layout.acceptance.read_text())
    row = next(
        r
        for r in summary.results
        if r.method == method and r.set == SHARED and r.category == "*" and r.temperature == 0.0
    )
    return {"acceptance_length": row.acceptance_length, "per_position": row.acceptance_per_position}


def training_record(layout: Layout) -> dict:
    metrics = TrainingMetrics.read(layout.training_metrics)
    last = metrics.epochs[-1]["val"] if metrics.epochs else {}
    with layout.benchmark("train").open() as handle:
        seconds = float(next(csv.DictReader(handle, delimiter="\t"))["s"])
    return {
        "validation_full_acc": [round(last[k], 4) for k in sorted(last) if k.startswith("full_acc_")],
        "train_seconds": seconds,
        "epochs_trained": len(metrics.epochs),
        "started_from": metrics.started_from,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "results/bench_from_pretrained")
    parser.add_argument("--epochs", type=int, default=5, help="epochs of the second batch (scratch and fine-tuned)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.003, 0.001, 0.0003])
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(CONFIG.read_text())
    parts = split_questions(work)
    heldout = parts["heldout"]

    snakemake(run_config(base, work, "a", parts["first_half"], heldout), "a", work)
    a = Layout(work / "a")
    start = held_out(a, "eagle3") | training_record(a)

    second = Layout(work / "b")
    scratch_config = run_config(base, work, "b", parts["second_half"], heldout, epochs=args.epochs)
    snakemake(scratch_config, "scratch", work)
    scratch = held_out(second, "eagle3") | training_record(second)

    by_lr = {}
    for lr in args.lrs:
        fine = run_config(
            base,
            work,
            "b",
            parts["second_half"],
            heldout,
            epochs=args.epochs,
            from_pretrained=str(a.drafter),
            fine_tune_lr=lr,
        )
        snakemake(fine, f"fine_tuned_lr{lr:g}", work)
        by_lr[str(lr)] = held_out(second, "eagle3") | training_record(second)
        by_lr[str(lr)]["start_measured_here"] = held_out(second, "start")
    best = max(by_lr, key=lambda lr: by_lr[lr]["acceptance_length"])
    write_result(
        "from_pretrained",
        {
            "start": start["acceptance_length"],
            "fine_tuned": by_lr[best]["acceptance_length"],
            "scratch": scratch["acceptance_length"],
            "fine_tuned_lr": float(best),
            "epochs_second_batch": args.epochs,
            "epochs_start": base["training"]["epochs"],
            "scratch_lr": base["training"]["lr"],
            "questions": {name: len(path.read_text().splitlines()) for name, path in parts.items()},
            "measured_on": f"held-out set of {HELDOUT} demo questions in neither half; greedy, k=3, concurrency 8",
            "detail": {"start": start, "scratch": scratch, "fine_tuned_by_lr": by_lr},
        },
    )


if __name__ == "__main__":
    main()
