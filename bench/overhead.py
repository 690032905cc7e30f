"""Overhead: the workflow end to end vs. the same stages by hand with the bare tools.

    .venv/bin/python bench/overhead.py [--reps 2] [--workdir /tmp/draftsmith-overhead]

Both sides run the demo's settings on the same prebuilt demo target and the same
questions: the workflow (`snakemake --cores all --resources gpu=8`, every rule
including preflight, plan and report) on the demo config with one shard per stage and
no untrained baseline (so each tool runs once, as by hand), and bench/overhead_bare.sh
(vLLM servers, the speculators CLI and curl in a plain script). Both run a snapshot of
the code taken at the start, so editing the repository cannot change a running
benchmark (bash reads a script while it runs it). Repetitions are interleaved, bare
then workflow, then the other way round, because this machine is noisy.
Goal: ratio <= 1.10. Writes bench/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from results_file import write_result
from snakemake.utils import validate

from draftsmith import questions
from draftsmith.demo_model import build_demo_model
from draftsmith.preflight import default_install_cache
from draftsmith.records import EvaluationSummary
from draftsmith.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ("Snakefile", "workflow", "config", "profiles", "envs")


def bench_config(model: Path) -> dict:
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    config["target"].update(model=str(model), build_demo=False)
    config["questions"].update(source=str(ROOT / config["questions"]["source"]), shards=1)
    config["extraction"]["shards"] = 1
    config["evaluation"]["compare_untrained"] = False
    return config


def copy_files(names: tuple[str, ...], source: Path, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        (shutil.copytree if (source / name).is_dir() else shutil.copy2)(source / name, target / name)
    return target


def run_workflow(config: dict, code: Path, workdir: Path) -> float:
    copy_files(WORKFLOW_FILES, code, workdir)
    (workdir / "config/overhead.yaml").write_text(yaml.safe_dump(config))
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "--configfile",
        "config/overhead.yaml",
        "--cores",
        "all",
        "--resources",
        "gpu=8",
    ]
    return timed(command, code, workdir, workdir / "snakemake.log")


def run_bare(model: Path, questions_dir: Path, code: Path, out: Path) -> float:
    out.mkdir(parents=True)
    command = ["bash", str(code / "bench/overhead_bare.sh"), str(model), str(questions_dir), str(out)]
    return timed(command, code, out, out / "script.log")


def timed(command: list[str], code: Path, cwd: Path, log: Path) -> float:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(code / "workflow"),
    }
    started = time.monotonic()
    with log.open("w") as handle:
        subprocess.run(command, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, check=True)
    return time.monotonic() - started


def acceptance(path: Path) -> float:
    return EvaluationSummary.read(path).acceptance_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/draftsmith-overhead"))
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)

    code = copy_files((*WORKFLOW_FILES, "bench"), ROOT, args.workdir / "code")
    model = args.workdir / "demo_model"
    config = bench_config(model)
    build_demo_model(model, train_seconds=0, max_steps=config["target"]["demo_train_steps"], seed=0, eval_per_task=0)
    validate(config, str(ROOT / "workflow/schemas/config.schema.yaml"))
    questions.run(RunConfig.from_dict(config), args.workdir / "questions")  # the same files the workflow's stage writes
    # As for a user who has run the workflow before on this install: the preflight's install
    # checks are cached (draftsmith/preflight.py), so every repetition finds them so.
    checks = args.workdir / "install_checks"
    timed(
        [
            sys.executable,
            "-m",
            "draftsmith.preflight",
            "--settings",
            json.dumps(config),
            "--results",
            str(checks),
            "--output",
            str(checks / "ok.json"),
            "--install-cache",
            str(default_install_cache()),
        ],
        code,
        args.workdir,
        args.workdir / "install_checks.log",
    )

    reps = []
    for rep in range(args.reps):
        order = ["bare", "workflow"] if rep % 2 == 0 else ["workflow", "bare"]
        times, accepted = {}, {}
        for side in order:
            place = args.workdir / f"{side}_{rep}"
            if side == "workflow":
                times[side] = run_workflow(config, code, place)
                accepted[side] = acceptance(place / "results/eval/acceptance.json")
            else:
                times[side] = run_bare(model, args.workdir / "questions", code, place)
                accepted[side] = acceptance(place / "acceptance.json")
            print(f"rep {rep} {side}: {times[side]:.1f} s, acceptance {accepted[side]:.2f}", flush=True)
        reps.append(
            {
                "order": order,
                "seconds": times,
                "acceptance_length": accepted,
                "ratio": times["workflow"] / times["bare"],
            }
        )

    write_result(
        "overhead",
        {
            "goal": "workflow / bare <= 1.10",
            "settings": "demo config (1,200 questions, 60 held out, 15 epochs), 1 shard per stage, "
            "no untrained baseline; "
            "preflight's install checks cached by a run before the repetitions",
            "machine": f"{os.cpu_count()} cores",
            "repetitions": reps,
            "median_ratio": round(statistics.median(r["ratio"] for r in reps), 3),
        },
    )


if __name__ == "__main__":
    main()
