"""Where every benchmark writes its result: bench/results/<name>.json, also printed; and the
workflow run that benchmarks of whole runs share."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


def write_result(name: str, result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    (RESULTS / f"{name}.json").write_text(text)
    print(text, end="")


def run_workflow(config: dict, path: Path, gpus: int = 8) -> None:
    """``snakemake`` on ``config`` (written to ``path``), its output appended to a log beside it;
    a failed run stops the benchmark, naming the log."""
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = path.with_suffix(".snakemake.log")
    with log_path.open("a") as log:
        command = [sys.executable, "-m", "snakemake", "--cores", "all", "--resources", f"gpu={gpus}"]
        done = subprocess.run([*command, "--configfile", str(path)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{path.stem}: snakemake failed; see {log_path}")
