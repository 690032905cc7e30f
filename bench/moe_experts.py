"""The DeepSeek demo target's build: transformers' MoE expert implementations on 2 CPU cores.

transformers 5.x can run a MoE layer's experts as the eager per-expert loop (the default),
as one batched matmul over every expert ("batched_mm": each token through every expert's
weights, then masked) or as grouped matmuls ("grouped_mm"). The build (rule demo_model,
600 steps for config/deepseek-v3-tiny.yaml) is a large share of the DeepSeek e2e run in CI,
so this times its training step (batch 32, AdamW) under each, from the same seed, and
records the loss after the timed steps (equal losses: the same computation).

    python bench/moe_experts.py [--steps 20] [--warmup 5]
"""

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from results_file import write_result
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))
from draftsmith import demo_language, demo_model  # noqa: E402

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def seconds_per_step(implementation: str, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    torch.set_flush_denormal(True)
    tokenizer = demo_language.build_tokenizer()
    config = demo_model.model_config(tokenizer, "deepseek_v3")
    model = AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=demo_model.LEARNING_RATES["deepseek_v3"])
    rng = random.Random(0)
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        loss = model(**demo_model.make_batch(tokenizer, rng, 32)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    per_step = (time.perf_counter() - started) / steps
    print(f"{implementation}: {per_step:.3f} s/step", flush=True)
    return {"s_per_step": round(per_step, 4), "loss_after": round(loss.item(), 5), "steps_timed": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--slow-steps", type=int, default=3, help="timed steps for batched_mm (about 18 s each)")
    args = parser.parse_args()
    results = {
        name: seconds_per_step(name, args.slow_steps if name == "batched_mm" else args.steps, args.warmup)
        for name in IMPLEMENTATIONS
    }
    eager = results["eager"]["s_per_step"]
    for result in results.values():
        result["vs_eager"] = round(result["s_per_step"] / eager, 2)
    write_result(
        "moe_experts",
        {
            "what": "DeepSeek demo target, one training step (batch 32, AdamW), torch threads = cores",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "by_implementation": results,
        },
    )


if __name__ == "__main__":
    main()
