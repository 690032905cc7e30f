"""Planning at scale: `snakemake -n` and a no-op rerun for 1,000,000 questions with 256
shards per stage, timed with peak memory. Goal: < 10 s each.

    .venv/bin/python bench/planning.py [--questions 1000000] [--shards 256] [--repeats 3]

Builds a scratch copy of the workflow with a production-like config (CUDA, TP=8, a target
directory holding only Kimi's config.json, a local 1M-line question file), then alternates
dry runs and no-op reruns (every output present and up to date). Writes
bench/results/planning.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml
from results_file import write_result

ROOT = Path(__file__).resolve().parents[1]
# Stage order, so that created outputs get increasing modification times.
RULE_ORDER = [
    "questions",
    "generate",
    "dataset",
    "extract",
    "training_view",
    "train",
    "untrained_drafter",
    "evaluation_sets",
    "evaluate_baseline",
    "evaluate_drafter",
    "evaluate_untrained",
    "evaluate",
    "completion_lengths",
    "training_curves",
    "run_metadata",
    "plan_snapshot",
]
KIMI_CONFIG = {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840, "num_attention_heads": 64}


def scratch_workflow(workdir: Path, questions: int, shards: int) -> Path:
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    for name in ("Snakefile", "workflow", "config", "profiles", "envs"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, workdir / name)
    model = workdir / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KIMI_CONFIG))
    with (workdir / "questions.jsonl").open("w") as handle:
        for i in range(questions):
            handle.write(f'{{"prompt": "question number {i}"}}\n')
    config = yaml.safe_load((ROOT / "config/kimi-k2.5-int4.yaml").read_text())
    config["target"]["model"] = str(model)
    config["questions"].update(source="questions.jsonl", limit=None, shards=shards)
    config["extraction"]["shards"] = shards
    path = workdir / "config" / "scale.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def timed(command: list[str], cwd: Path) -> dict:
    """Wall seconds and peak RSS (GNU time) of one command."""
    run = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M", *command], cwd=cwd, capture_output=True, text=True)
    seconds, kib = re.findall(r"TIME ([\d.]+) (\d+)", run.stderr)[-1]
    return {
        "seconds": float(seconds),
        "peak_rss_mib": int(kib) / 1024,
        "returncode": run.returncode,
        "stdout": run.stdout,
        "stderr": run.stderr,
    }


def create_outputs(dry_run_stdout: str, workdir: Path) -> int:
    """Create every planned output (directories for extension-less paths), oldest stage first."""
    planned: list[tuple[int, str]] = []
    rule = None
    for line in dry_run_stdout.splitlines():
        match = re.match(r"^(?:local)?rule (\w+):", line)
        if match:
            rule = match.group(1)
        elif line.strip().startswith("output:") and rule in RULE_ORDER:
            for path in line.split("output:", 1)[1].split(","):
                planned.append((RULE_ORDER.index(rule), path.strip()))
    base = time.time()  # newer than the question file; each stage one second after the last
    for rank, name in planned:
        path = workdir / name
        if path.suffix:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        else:
            path.mkdir(parents=True, exist_ok=True)
        os.utime(path, (base + rank, base + rank))
    return len(planned)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/draftsmith-bench-planning"))
    args = parser.parse_args()

    config = scratch_workflow(args.workdir, args.questions, args.shards)
    snakemake = [sys.executable, "-m", "snakemake", "--configfile", str(config), "--cores", "2"]
    first = timed([*snakemake, "-n"], args.workdir)
    assert first["returncode"] == 0, first["stderr"][-2000:]
    jobs = int(re.search(r"^total\s+(\d+)", first["stdout"], re.M).group(1))
    outputs = create_outputs(first["stdout"], args.workdir)

    dry, noop = [], []
    for _ in range(args.repeats):  # interleaved: the machine's noise hits both alike
        dry_run = timed([*snakemake, "-n", "--forceall"], args.workdir)
        assert dry_run["returncode"] == 0, dry_run["stderr"][-2000:]
        dry.append(dry_run)
        rerun = timed(snakemake, args.workdir)
        assert rerun["returncode"] == 0 and "Nothing to be done" in rerun["stdout"] + rerun["stderr"], rerun["stderr"][
            -2000:
        ]
        noop.append(rerun)

    summary = lambda runs: {  # noqa: E731
        "seconds": [r["seconds"] for r in runs],
        "median_seconds": sorted(r["seconds"] for r in runs)[len(runs) // 2],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
    }
    result = {
        "questions": args.questions,
        "shards_per_stage": args.shards,
        "jobs_planned": jobs,
        "outputs_present_for_noop": outputs,
        "machine": f"{os.cpu_count()} cores",
        "dry_run_all_jobs": summary(dry),
        "noop_rerun": summary(noop),
        "goal_seconds": 10,
    }
    write_result("planning", result)


if __name__ == "__main__":
    main()
