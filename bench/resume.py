"""Resume efficiency: kill extraction about half way (SIGKILL), rerun, and compare the
rows requested by the rerun with the rows that were missing. Goal: <= 1.02.

    .venv/bin/python bench/resume.py [--results results]     # after `make demo`

Runs the real extraction stage (vLLM CPU build) on the demo's dataset as one shard, in a
scratch staging directory. Writes bench/results/resume.json.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
from pathlib import Path

import yaml
from results_file import write_result
from snakemake.utils import validate

from draftsmith import extract
from draftsmith.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


def demo_settings() -> dict:
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    validate(config, str(ROOT / "workflow/schemas/config.schema.yaml"))
    config["target"]["model"] = str(ROOT / config["target"]["model"])
    return {key: config[key] for key in ("target", "server", "layers", "extraction", "device", "gpu_slot")}


def staged(staging: Path) -> int:
    return len(list(staging.glob("hs_*.safetensors")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/draftsmith-bench-resume"))
    args = parser.parse_args()
    settings = demo_settings()
    dataset = args.results / "dataset"
    rows = len(extract.load_shard(dataset, 0, 1))
    staging, output = args.workdir / "staging", args.workdir / "output"
    subprocess.run(["rm", "-rf", str(args.workdir)], check=True)

    command = extract.shard_command(json.dumps(settings), dataset, staging, output)
    with (args.workdir.parent / "draftsmith-bench-resume-run1.log").open("w") as log:
        first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while staged(staging) < rows // 2:
            if first.poll() is not None:
                raise SystemExit("extraction ended before half way; see the run1 log")
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait()
    present = staged(staging)
    time.sleep(2)  # the server dies with its parent (PR_SET_PDEATHSIG)

    result = extract.run(RunConfig.from_dict(settings), dataset, 0, 1, staging, output)
    requested = len(result.requested)
    missing = rows - present
    report = {
        "rows": rows,
        "staged_when_killed": present,
        "missing_after_kill": missing,
        "requested_by_rerun": requested,
        "ratio": round(requested / missing, 4),
        "goal": 1.02,
        "published_rows": len(list(output.glob("hs_*.safetensors"))),
    }
    write_result("resume", report)


if __name__ == "__main__":
    main()
