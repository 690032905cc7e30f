"""PyTorch training on a CPU that other work shares: OpenMP's default waiting vs PASSIVE.

Two CPU-bound jobs on 2 cores (two test workers, a second checkout's suite, someone else's
job) slowed the DeepSeek target's build about four times, more than the halving sharing
explains: OpenMP threads spin while they wait for a descheduled sibling, and the spinning
takes the core the sibling needs. ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep instead.
This runs a few steps of that build (``python -m draftsmith.demo_model --architecture
deepseek_v3``) four ways, alone and beside one busy thread, with the default policy and with
PASSIVE, and records each build's training seconds. The README's advice for busy machines
quotes it; the default stays, because alone PASSIVE is slower.

    python bench/cpu_contention.py [--steps 40]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

from results_file import write_result

BUSY = "while True: pass"


def train_seconds(steps: int, policy: str | None, busy: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    hog = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        with tempfile.TemporaryDirectory() as scratch:
            build = subprocess.run(
                [sys.executable, "-m", "draftsmith.demo_model", "--architecture", "deepseek_v3"]
                + ["--output", f"{scratch}/model", "--train-seconds", "0", "--eval-per-task", "0"]
                + ["--max-steps", str(steps), "--min-steps", str(steps), "--seed", "0"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return float(re.search(r"trained \d+ steps in ([\d.]+)s", build.stderr + build.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    steps = parser.parse_args().steps
    runs = {
        f"{where}_{policy or 'default'}": train_seconds(steps, policy, where == "beside_busy_thread")
        for where in ("alone", "beside_busy_thread")
        for policy in (None, "PASSIVE")
    }
    write_result(
        "cpu_contention",
        {
            "goal": "a record: how much a busy core slows training, by OpenMP wait policy",
            "cores": len(os.sched_getaffinity(0)),
            "steps": steps,
            "train_seconds": runs,
            "slowdown_beside_busy_thread": {
                "default": round(runs["beside_busy_thread_default"] / runs["alone_default"], 2),
                "PASSIVE": round(runs["beside_busy_thread_PASSIVE"] / runs["alone_PASSIVE"], 2),
            },
            "passive_cost_alone": round(runs["alone_PASSIVE"] / runs["alone_default"], 2),
        },
    )


if __name__ == "__main__":
    main()
