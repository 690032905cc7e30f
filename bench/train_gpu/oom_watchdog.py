"""The training stage's stall watchdog against a real out-of-memory crash on one GPU.

    python bench/train_gpu/oom_watchdog.py --data DIR --out DIR [--stall-s 90]

    python bench/train_gpu/oom_watchdog.py ... --config default_seq128k

Runs the trainer exactly as draftsmith.train does on a GPU (torchrun under the guard,
through run_trainer with its watchdog) with the Kimi example's settings and one of
bench.py's CONFIGS whose step does not fit in an H200. Default: the production flags at
65,536 tokens per step, where the worker was once seen to print its OutOfMemoryError and
then hang, holding the GPU. Records how the stage ended and when, and the GPU memory and
processes left afterwards, to OUT/oom_watchdog-<config>.json. Data: make_synthetic.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench/train_gpu"))

from bench import CONFIGS, stage_argv  # noqa: E402
from draftsmith.errors import TrainError  # noqa: E402
from draftsmith.train import launcher  # noqa: E402
from draftsmith.trainer_process import run_trainer  # noqa: E402

CONFIGS["default_seq128k"] = (131072, [], {})


def gpu_memory_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    return int(out.split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stall-s", type=float, default=90)
    parser.add_argument("--config", default="flex_seq64k_w4_log50", choices=sorted(CONFIGS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / f"oom_watchdog-{args.config}.log"

    seq, extra, env = CONFIGS[args.config]
    os.environ.update(env)
    command = launcher({"device": "cuda"}, 1) + stage_argv(args.data, args.out / "save", seq, extra)
    command += ["--mask-token-id", "0"]  # the synthetic verifier has no tokenizer
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "workflow"), os.environ.get("PYTHONPATH", "")])
    began = time.monotonic()
    outcome = "finished"
    # run_trainer watches its own stderr (the rule's log in the workflow): point it at a file.
    saved_stderr = os.dup(2)
    with log_path.open("w") as log:
        os.dup2(log.fileno(), 2)
        try:
            run_trainer(command, args.out / "metrics.jsonl", args.stall_s)
        except TrainError as error:
            outcome = f"TrainError: {error}"
        finally:
            os.dup2(saved_stderr, 2)
    stopped_after = time.monotonic() - began

    text = log_path.read_text(errors="replace")
    oom = re.search(r"OutOfMemoryError|CUDA out of memory", text)
    time.sleep(5)
    leftovers = subprocess.run(["pgrep", "-af", "speculators_cpu|draftsmith.guard"], capture_output=True, text=True)
    result = {
        "config": args.config,
        "total_seq_len": seq,
        "extra_args": extra,
        "stall_timeout_s": args.stall_s,
        "outcome": outcome,
        "out_of_memory_in_log": bool(oom),
        "stage_ended_after_s": round(stopped_after, 1),
        "gpu_memory_used_after_mib": gpu_memory_used_mib(),
        "processes_left": [line for line in leftovers.stdout.splitlines() if "pgrep" not in line],
        "log_tail": text.splitlines()[-12:],
    }
    (args.out / f"oom_watchdog-{args.config}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
