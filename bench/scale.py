"""Training past disk: offline, a half budget and online, from one finished dataset.

For each mode (``hidden_states.disk_budget`` all, half the offline bytes, 0) the hidden
states of the run before are deleted, so each starts from the same dataset with none on
disk; the workflow then extracts what the budget stores, trains (with its capture server
when rows are past the budget) and measures the drafter at k=3 greedy on the held-out
questions. Meanwhile a sampler reads the bytes
of hidden states on disk under ``results_dir`` (published shards, staged rows and
captured files in flight, each inode once) every 0.25 s. Recorded per mode:

- peak hidden-state bytes on disk during the run, and the budget it had;
- acceptance length (greedy, k=3, held-out set);
- wall time of the training job (Snakemake's benchmark record);
- model loads (vLLM servers started by the extraction and training jobs).

    python bench/scale.py --workdir DIR [--epochs 4]

DIR is a finished run of the demo (a copy of the repository after ``make demo``); the
modes run in its results in turn, offline first, and leave it at online. Results go to
``bench/results/scale.json``.

Every mode trains ``--epochs`` epochs (4 by default, not the demo's 15): on 2 cores the
capture server answers about 9 rows a second, so fully online at 15 epochs alone would take
half an hour. The acceptance lengths compare like with like; they are below the demo's.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from results_file import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))
from draftsmith.layout import Layout  # noqa: E402
from draftsmith.records import (  # noqa: E402
    HELDOUT,
    Measurement,  # noqa: E402
    acceptance_length,
    merged,
)

DRAFT_LENGTH = 3
SAMPLE_EVERY_S = 0.25
# The measurement the bench needs, at one concurrency: the evaluation's other phases
# (sets, sampled, a second draft length) do not depend on where the states came from.
EVALUATION = {"num_speculative_tokens": DRAFT_LENGTH, "concurrency": 4, "sampled": False, "compare_untrained": False}


def hidden_state_bytes(layout: Layout) -> int:
    """Bytes of safetensors files where hidden states live, each inode once."""
    seen: dict[tuple[int, int], int] = {}
    roots = [layout.hidden_states, layout.staging_for("hidden_states"), layout.staging_for("train")]
    for root in roots:
        for directory, _dirs, files in os.walk(root):
            for name in files:
                if name.endswith(".safetensors") and "checkpoints" not in directory:
                    try:
                        stat = os.stat(os.path.join(directory, name))  # follows the view's links
                    except FileNotFoundError:  # deleted between the walk and the stat
                        continue
                    seen[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(seen.values())


class DiskSampler:
    def __init__(self, layout: Layout):
        self.layout, self.peak, self.samples = layout, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, hidden_state_bytes(self.layout))
            self.samples += 1
            self._stop.wait(SAMPLE_EVERY_S)

    def __enter__(self) -> "DiskSampler":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()


def heldout_acceptance(measurement: Path) -> float:
    phases = Measurement.read(measurement).phases
    greedy = [p for p in phases if p.set == HELDOUT and p.temperature == 0.0]
    return acceptance_length(merged(t for p in greedy for t in p.categories.values()))


def model_loads(layout: Layout, since: float) -> int:
    """Servers started by this run's extraction and training jobs (logs written since)."""
    logs = [*layout.logs.glob("extract/*.log"), layout.log("train")]
    return sum(
        log.read_text().count("starting vLLM for") for log in logs if log.is_file() and log.stat().st_mtime >= since
    )


def delete_hidden_states(layout: Layout) -> None:
    for directory in (layout.hidden_states, layout.staging_for("hidden_states"), layout.staging_for("train")):
        shutil.rmtree(directory, ignore_errors=True)


@dataclass(frozen=True)
class FinishedDemo:
    """A finished run of the demo (``--workdir``) that a bench trains again from its dataset,
    for ``--epochs`` epochs a mode."""

    workdir: Path
    epochs: int

    @classmethod
    def from_args(cls, doc: str, epochs: int) -> "FinishedDemo":
        parser = argparse.ArgumentParser(description=doc.splitlines()[0])
        parser.add_argument("--workdir", type=Path, required=True)
        parser.add_argument("--epochs", type=int, default=epochs)
        args = parser.parse_args()
        return cls(args.workdir.resolve(), args.epochs)

    @property
    def layout(self) -> Layout:
        return Layout(self.workdir / "results")

    def run_mode(self, name: str, hidden_states: dict) -> dict:
        """One run from the finished dataset with this ``hidden_states`` section."""
        workdir, layout = self.workdir, self.layout
        delete_hidden_states(layout)
        override = workdir / f"scale_{name}.yaml"
        training = {**yaml.safe_load((workdir / "config/config.yaml").read_text())["training"], "epochs": self.epochs}
        override.write_text(
            json.dumps({"hidden_states": hidden_states, "evaluation": EVALUATION, "training": training})
        )
        target = layout.drafter_measurement(DRAFT_LENGTH).relative_to(workdir)
        command = [sys.executable, "-m", "snakemake", "--configfile", "config/config.yaml", str(override)]
        command += ["--cores", "all", "--resources", "gpu=8", "--forcerun", "train", "--", str(target)]
        started = time.time()
        with DiskSampler(layout) as sampler:
            subprocess.run(command, cwd=workdir, check=True)
        train_seconds = float(layout.benchmark("train").read_text().splitlines()[1].split("\t")[0])
        return {
            "mode": name,
            **hidden_states,
            "epochs": self.epochs,
            "peak_hidden_state_bytes": sampler.peak,
            "disk_samples": sampler.samples,
            "hidden_state_bytes_after": hidden_state_bytes(layout),
            "acceptance_length": round(heldout_acceptance(workdir / target), 3),
            "train_seconds": train_seconds,
            "model_loads": model_loads(layout, started),
            "run_seconds": round(time.time() - started, 1),
        }


def acceptance_gap(mode: dict, reference: dict) -> float:
    return round(mode["acceptance_length"] - reference["acceptance_length"], 3)


def main() -> None:
    demo = FinishedDemo.from_args(__doc__, epochs=4)
    modes = [demo.run_mode("offline", {"disk_budget": "all"})]
    offline_bytes = modes[0]["hidden_state_bytes_after"]
    modes.append(demo.run_mode("budget", {"disk_budget": offline_bytes // 2}))
    modes.append(demo.run_mode("online", {"disk_budget": 0}))
    offline, budget, online = modes
    write_result(
        "scale",
        {
            "goal": "online peak <= 5% of offline's bytes; budget peak <= budget + one batch in flight; "
            "acceptance of online and budget within 0.15 of offline",
            "offline_hidden_state_bytes": offline_bytes,
            "modes": modes,
            "online_peak_share_of_offline": round(online["peak_hidden_state_bytes"] / offline_bytes, 4),
            "budget_peak_over_budget_bytes": budget["peak_hidden_state_bytes"] - budget["disk_budget"],
            "acceptance_gap_to_offline": {m["mode"]: acceptance_gap(m, offline) for m in (budget, online)},
        },
    )


if __name__ == "__main__":
    main()
