"""The demo target's training schedule: peak learning rate against steps, by the quality of the
target it builds (greedy exact match on fresh examples of every task, and the final loss).

The DeepSeek-V3 target's build is CI's largest single cost (about 0.7 s a step on 2 cores:
500 steps are 6 minutes), so fewer steps at a higher rate are worth knowing. The sweep runs the
build's own training loop (``demo_model.train``) and its own check (``demo_model.evaluate``),
on a GPU when there is one: the choice of schedule carries over, the seconds do not (the CPU
seconds per step are measured by the workflow's benchmark record of the `demo_model` rule).

    python bench/demo_target_schedule.py --architecture deepseek_v3 --lrs 1e-3 2e-3 --steps 300 500
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))
from results_file import write_result  # noqa: E402

from draftsmith import demo_model  # noqa: E402
from draftsmith.demo_language import build_tokenizer  # noqa: E402


def build_and_check(architecture: str, lr: float, steps: int, batch: int, seed: int, per_task: int) -> dict:
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = demo_model.AutoModelForCausalLM.from_config(demo_model.model_config(tokenizer, architecture))
    started = time.monotonic()
    stats = demo_model.train(
        model, tokenizer, train_seconds=0, seed=seed, max_steps=steps, lr=lr, batch_size=batch, log_every_s=60
    )
    seconds = time.monotonic() - started
    # As the build does: the check runs on the bf16 model vLLM will serve.
    by_task = demo_model.evaluate(model.to(torch.bfloat16), tokenizer, seed=seed, per_task=per_task)
    return {
        "lr": lr,
        "steps": steps,
        "batch_size": batch,
        "examples_trained": steps * batch,
        "final_loss": stats.final_loss,
        "exact_match": round(sum(by_task.values()) / len(by_task), 4),
        "exact_match_by_task": by_task,
        "train_s": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="deepseek_v3", choices=demo_model.ARCHITECTURES)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 2e-3, 3e-3])
    parser.add_argument("--steps", type=int, nargs="+", default=[250, 300, 350, 500])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32], help="the build's is 32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-task", type=int, default=16, help="fresh examples per task in the check")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The build's loop makes its batches with torch.full/torch.tensor: this puts them on the GPU.
    torch.set_default_device(device)
    torch.set_flush_denormal(True)
    runs = []
    for batch in args.batch_sizes:
        for lr in args.lrs:
            for steps in args.steps:
                runs.append(build_and_check(args.architecture, lr, steps, batch, args.seed, args.per_task))
                print(runs[-1], file=sys.stderr, flush=True)
    write_result(
        f"demo_target_schedule_{args.architecture}",
        {
            "architecture": args.architecture,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "seed": args.seed,
            "examples_per_task": args.per_task,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
