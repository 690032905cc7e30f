"""How long the preflight takes before any work starts: the seconds a user waits to hear
that the install or the config is broken. Goal: < 10 s with the install checks, < 3 s once
they are remembered (tests/test_preflight.py only bounds it generously at 60 s, so that a
busy machine does not fail the suite).

    .venv/bin/python bench/preflight.py [--repeats 3]

Runs `python -m draftsmith.preflight` on the demo config (the target is a directory holding
the demo's config.json only), alternating a run with an empty install cache (every check:
vLLM's and speculators' names, flags and options) and a run whose install checks are
remembered. Writes bench/results/preflight.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from results_file import write_result
from snakemake.utils import validate

ROOT = Path(__file__).resolve().parents[1]


def timed(command: list[str]) -> float:
    started = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(run.stderr[-2000:])
    return round(time.monotonic() - started, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        target = scratch / "model"
        target.mkdir()
        model = {"num_hidden_layers": 6, "hidden_size": 128, "num_attention_heads": 2, "vocab_size": 226}
        (target / "config.json").write_text(json.dumps(model))
        config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
        validate(config, str(ROOT / "workflow/schemas/config.schema.yaml"))  # fills the defaults
        config["target"]["model"] = str(target)
        base = [sys.executable, "-m", "draftsmith.preflight", "--settings", json.dumps(config)]
        base += ["--results", str(scratch / "results"), "--output", str(scratch / "ok.json")]
        full, cached = [], []
        for repeat in range(args.repeats):
            cache = scratch / f"cache{repeat}"
            full.append(timed([*base, "--install-cache", str(cache)]))
            cached.append(timed([*base, "--install-cache", str(cache)]))
    write_result(
        "preflight",
        {
            "goal": "< 10 s with every install check, < 3 s when they are remembered",
            "seconds_with_install_checks": full,
            "seconds_install_checks_remembered": cached,
            "median_with_install_checks": statistics.median(full),
            "median_install_checks_remembered": statistics.median(cached),
        },
    )


if __name__ == "__main__":
    main()
