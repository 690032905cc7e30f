"""The real model on real conversations at two data sizes: does more data teach the drafter more?

Runs the whole workflow on ``config/smollm2-sharegpt.yaml`` (SmolLM2-135M-Instruct from its
GGUF, ShareGPT V3 first turns, HumanEval as a second set; `make real-data` first) once per
data size, each in its own results directory under ``--work`` with one shared target
checkpoint. Only the number of questions changes between sizes: the held-out count, the
answers' length, the epochs and every evaluation setting are the config's.

Recorded per size, from the run's own files:
- the questions stage's counts (asked for, used, dropped by reason);
- wall seconds per rule (summed over its jobs, from Snakemake's log) and tokens per second
  of generation (answer tokens / generation seconds, model load included) and of training
  (tokens of every epoch / training seconds, model load included);
- the drafter's validation metrics per epoch (speculators' own, first TTT position);
- per prompt set (ShareGPT held-out, HumanEval), greedy, at the config's draft length and
  concurrency: acceptance length and tokens per target step of the trained drafter, the
  untrained drafter and n-gram lookup, and tokens/s of each and of the target alone;
- the recommendation the run made.

A plot of acceptance against training questions, per set and method, goes beside the JSON
(``bench/results/real_model.png``).

    python bench/real_model.py --sizes 100 400 [--work results/bench_real_model]

A size is the number of training questions; the held-out questions come on top. Each size
is a plain Snakemake run, so an interrupted bench resumes where it stopped.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml
from results_file import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflow"))
from draftsmith.evaluation_summary import tokens_per_step  # noqa: E402
from draftsmith.layout import Layout  # noqa: E402
from draftsmith.records import EvaluationSummary, Measurement, TrainingMetrics, acceptance_length, merged  # noqa: E402  # noqa: E402

CONFIG = ROOT / "config/smollm2-sharegpt.yaml"
TIMESTAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
RULE = re.compile(r"^(?:local)?rule (\w+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
FINISHED = re.compile(r"^Finished jobid: (\d+)|^Finished job (\d+)\.")


def size_config(base: dict, size: int, work: Path) -> dict:
    config = json.loads(json.dumps(base))
    config["results_dir"] = str(work / f"questions_{size}")
    config["target"]["model"] = str(work / "target")  # converted once, shared by the sizes
    config["questions"]["limit"] = size + config["questions"]["heldout"]
    return config


def rule_seconds(log_text: str) -> dict[str, float]:
    """Wall seconds per rule, summed over its jobs, from Snakemake's own log lines."""
    started: dict[str, tuple[str, datetime]] = {}
    seconds: dict[str, float] = {}
    now, rule = None, None
    for line in log_text.splitlines():
        if stamp := TIMESTAMP.match(line):
            now = datetime.strptime(stamp.group(1), "%a %b %d %H:%M:%S %Y")
        elif found := RULE.match(line):
            rule = found.group(1)
        elif (job := JOBID.match(line)) and rule and now:
            started[job.group(1)] = (rule, now)
            rule = None
        elif (done := FINISHED.match(line)) and now:
            job_id = done.group(1) or done.group(2)
            if job_id in started:
                name, began = started.pop(job_id)
                seconds[name] = seconds.get(name, 0.0) + (now - began).total_seconds()
    return seconds


def snakemake(
    config: dict, name: str, work: Path, targets: tuple[str, ...] = (), cores: str = "all", gpus: int = 8
) -> float:
    """One resumable Snakemake run of ``config``, in seconds; its output goes to ``work/<name>.log``."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    with (work / f"{name}.log").open("a") as log:
        done = subprocess.run(
            # Targets first: --configfile takes every argument after it.
            [sys.executable, "-m", "snakemake", *targets, "--cores", cores, "--resources", f"gpu={gpus}"]
            + ["--configfile", str(path)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        raise SystemExit(f"{name} failed; see {work / name}.log")
    return round(time.monotonic() - started, 1)


def run_size(config: dict, size: int, work: Path, cores: str) -> dict:
    name = f"questions_{size}"
    seconds = snakemake(config, name, work, cores=cores)
    return {"wall_s_this_call": seconds, **measured(config, (work / f"{name}.log").read_text())}


def per_set(path: Path, k: int, concurrency: int) -> dict[str, dict]:
    """Greedy, at the default concurrency: each set's acceptance, tokens/step and tokens/s."""
    job = Measurement.read(path)
    sets = {}
    for phase in job.phases:
        if phase.temperature != 0.0 or phase.concurrency != concurrency:
            continue
        tally = merged(phase.categories.values())
        sets[phase.set] = {
            "requests": tally.requests,
            "tokens_per_s": round(tally.completion_tokens / phase.seconds, 2),
            **(
                {"acceptance_length": round(acceptance_length(tally), 4), "tokens_per_step": tokens_per_step(tally)}
                if k
                else {}
            ),
        }
    return sets


def measured(config: dict, log_text: str) -> dict:
    from datasets import load_from_disk

    layout = Layout(config["results_dir"])
    k, concurrency = config["evaluation"]["num_speculative_tokens"][0], config["evaluation"]["concurrency"][0]
    questions = json.loads(layout.questions_summary.read_text())
    seconds = rule_seconds(log_text)
    rows = load_from_disk(str(layout.dataset)).with_format(None)  # plain lists, not tensors
    answer_tokens = sum(sum(mask) for mask in rows["loss_mask"])
    trained_tokens = sum(rows["seq_len"]) * config["training"]["epochs"]
    metrics = TrainingMetrics.read(layout.drafter)
    summary = EvaluationSummary.read(layout.acceptance)
    methods = {
        "target_alone": per_set(layout.baseline_measurement, 0, concurrency),
        "drafter": per_set(layout.drafter_measurement(k), k, concurrency),
        "untrained_drafter": per_set(layout.untrained_measurement(k), k, concurrency),
        **{
            method: per_set(layout.free_method_measurement(method, k), k, concurrency)
            for method in config["evaluation"]["free_methods"]
        },
    }
    return {
        "questions": {
            key: questions[key]
            for key in ("rows_read", "questions", "train", "heldout", "too_long", "bad_rows_by_reason", "duplicates")
        },
        "training_rows": len(rows),
        "answer_tokens": answer_tokens,
        "rule_seconds": {name: round(s, 1) for name, s in sorted(seconds.items())},
        "generation_tokens_per_s": round(answer_tokens / seconds["generate"], 1) if seconds.get("generate") else None,
        "training_tokens_per_s": round(trained_tokens / seconds["train"], 1) if seconds.get("train") else None,
        "validation": [{"epoch": e["epoch"], **e.get("val", {})} for e in metrics.epochs],
        "published_epoch": metrics.published_epoch,
        "greedy": {"num_speculative_tokens": k, "concurrency": concurrency, "by_method": methods},
        "recommendation": [
            {
                "concurrency": r.concurrency,
                "temperature": r.temperature,
                "serve": r.serve,
                "serve_speedup": r.serve_speedup,
            }
            for r in summary.recommendation
        ],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(result["sizes"], key=int)
    methods = [m for m in result["sizes"][sizes[0]]["greedy"]["by_method"] if m != "target_alone"]
    sets = sorted(result["sizes"][sizes[0]]["greedy"]["by_method"]["drafter"])
    figure, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
    for axis, name in zip(axes[0], sets, strict=True):
        for method in methods:
            values = [result["sizes"][s]["greedy"]["by_method"][method][name]["acceptance_length"] for s in sizes]
            axis.plot([int(s) for s in sizes], values, marker="o", label=method)
        axis.set_title(f"{name}: acceptance length, k={result['num_speculative_tokens']}, greedy")
        axis.set_xlabel("training questions")
        axis.set_xscale("log")
        axis.set_xticks([int(s) for s in sizes], labels=sizes)
        axis.minorticks_off()
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 400], help="training questions per run")
    parser.add_argument("--work", type=Path, default=ROOT / "results/bench_real_model")
    parser.add_argument("--cores", default="all")
    args = parser.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(CONFIG.read_text())
    load_before = os.getloadavg()[0]
    sizes = {}
    for size in sorted(args.sizes):
        sizes[str(size)] = run_size(size_config(base, size, args.work), size, args.work, args.cores)
        print(f"size {size}: {json.dumps(sizes[str(size)]['greedy'])}", file=sys.stderr)
    result = {
        "config": str(CONFIG.relative_to(ROOT)),
        "cpu_count": os.cpu_count(),
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "num_speculative_tokens": base["evaluation"]["num_speculative_tokens"][0],
        "sizes": sizes,
    }
    write_result("real_model", result)
    plot(result, RESULTS / "real_model.png")


if __name__ == "__main__":
    main()
