"""Build an embedded demo's target model: a tiny Llama or DeepSeek-V3 trained on a synthetic language.

A random-weight target produces near-random text that no drafter can learn, so the demo's
acceptance length would stay near 1 whatever the pipeline did. Instead, this module trains a
6-layer Llama for about a minute of CPU time on the low-entropy language of
``demo_language`` (with its word-level tokenizer) and saves a Hugging Face model directory
that vLLM's CPU build serves. The model generates the assistant turn's
`<think> reasoning </think> answer </s>` itself, as the production reasoning models do.

The second architecture is the production family's (DeepSeek-V3, Kimi-K2.5): multi-head
latent attention at DeepSeek's real latent geometry (``kv_lora_rank`` 512 + rope 64, the
only one vLLM's CPU MLA kernel takes) and a mixture of experts (4 routed + 1 shared,
``noaux_tc`` sigmoid routing as DeepSeek-V3 and Kimi configure it: without it vLLM builds no
``e_score_correction_bias`` and cannot load the checkpoint). Everything else is tiny.
Measured on 2 AVX2 cores: about 0.8 s per step against the Llama's 0.2 s.

    python -m draftsmith.demo_model --output results/demo_model --train-seconds 60 --seed 0
    python -m draftsmith.demo_model --architecture deepseek_v3 --output DIR --max-steps 400
    python -m draftsmith.demo_model questions --output config/demo_questions.jsonl --count 1200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from draftsmith.demo_language import (
    SYSTEM_PROMPTS,
    TASKS,
    build_tokenizer,
    example_messages,
    make_example,
    render,
    write_questions,
)

# ---------------------------------------------------------------------------------------------
# Model and training
# ---------------------------------------------------------------------------------------------


ARCHITECTURES = ("llama", "deepseek_v3")
# Peak learning rates. The DeepSeek target diverged slowly at the Llama's 3e-3 (smoothed loss
# after 150 steps: 1e-2 2.98, 3e-3 1.66, 1e-3 1.17).
LEARNING_RATES = {"llama": 3e-3, "deepseek_v3": 1e-3}


def model_config(tokenizer: PreTrainedTokenizerFast, architecture: str = "llama") -> PretrainedConfig:
    """The tiny target: head_dim 64 because vLLM's CPU attention rejects small head sizes."""
    if architecture == "deepseek_v3":
        return deepseek_config(tokenizer)
    return LlamaConfig(
        hidden_size=128,
        intermediate_size=384,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        **shared_config(tokenizer),
    )


def shared_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """What both architectures share: six layers (the demo configs' ``layers: [1, 2, 4, 5]``
    end at the last), the tokenizer's vocabulary and special tokens, the context and untied
    embeddings."""
    return {
        "num_hidden_layers": 6,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def deepseek_config(tokenizer: PreTrainedTokenizerFast) -> DeepseekV3Config:
    """MLA at DeepSeek's latent geometry, MoE with routed and shared experts (module docstring)."""
    # topk_method, scoring_func and rope_scaling are not in the class's typed signature;
    # transformers keeps them as attributes, and vLLM reads them from config.json.
    return DeepseekV3Config(  # type: ignore[call-arg]
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        rope_scaling=None,
        **shared_config(tokenizer),
    )


def make_batch(tokenizer: PreTrainedTokenizerFast, rng: random.Random, batch_size: int) -> dict[str, torch.Tensor]:
    """Right-padded chat sequences; the loss covers the assistant turn and eos only
    (the question is random, so its loss would be an irreducible floor)."""
    rows, starts = [], []
    for _ in range(batch_size):
        example = make_example(rng)
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.1 else None
        messages = example_messages(example, system)
        prompt = render(tokenizer, messages[:-1], add_generation_prompt=True)
        full = render(tokenizer, messages)
        # Training and serving must agree: the served prompt is a prefix of the trained chat.
        if full[: len(prompt)] != prompt:
            raise AssertionError(f"chat template prefix mismatch for {example.question!r}")
        rows.append(full)
        starts.append(len(prompt))
    width = max(map(len, rows))
    input_ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, start : len(row)] = torch.tensor(row[start:])
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


@dataclass
class TrainStats:
    steps: int
    seconds: float
    final_loss: float
    eval_accuracy: float | None = None
    eval_by_task: dict[str, float] | None = None


def log(message: str) -> None:
    print(f"[demo_model] {message}", file=sys.stderr, flush=True)


def train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    *,
    train_seconds: float,
    seed: int,
    max_steps: int | None = None,
    min_steps: int = 0,
    batch_size: int = 32,
    lr: float = 3e-3,
    log_every_s: float = 5.0,
) -> TrainStats:
    """AdamW for a wall-time budget; the cosine schedule runs on elapsed time, not steps,
    so a slower machine trains fewer steps but still ends at a small learning rate.
    `min_steps` extends the time on a busy machine (other jobs can starve the 2 cores)."""
    if train_seconds <= 0 and max_steps is None:
        raise ValueError("give a time budget (train_seconds > 0) or max_steps")
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    start = last_log = time.monotonic()
    step, smoothed = 0, float("nan")
    while True:
        # Progress toward whichever budget runs out first; steps alone are reproducible.
        budgets = [(time.monotonic() - start) / train_seconds] if train_seconds > 0 else []
        budgets += [step / max_steps] if max_steps is not None else []
        progress = max(budgets)
        if min_steps:
            progress = min(progress, step / min_steps)
        if progress >= 1.0 and step > 0:
            break
        warmup = min(1.0, (step + 1) / 20)
        for group in optimizer.param_groups:
            group["lr"] = lr * warmup * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        loss = model(**make_batch(tokenizer, rng, batch_size)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * value
        now = time.monotonic()
        if now - last_log >= log_every_s:
            last_log = now
            elapsed = now - start
            eta = elapsed * (1 - progress) / max(progress, 1e-9)
            log(
                f"step {step} loss {smoothed:.4f} lr {optimizer.param_groups[0]['lr']:.2e} "
                f"elapsed {elapsed:.0f}s eta {eta:.0f}s"
            )
    seconds = time.monotonic() - start
    log(f"trained {step} steps in {seconds:.1f}s, final loss {smoothed:.4f}")
    model.eval()
    return TrainStats(steps=step, seconds=round(seconds, 2), final_loss=round(smoothed, 4))


@torch.no_grad()
def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, *, seed: int, per_task: int = 8
) -> dict[str, float]:
    """Greedy exact-match accuracy per task on fresh examples (the chain's first sanity check)."""
    rng = random.Random(seed + 7919)
    accuracy = {}
    for task in TASKS:
        correct = 0
        for _ in range(per_task):
            example = make_example(rng, task)
            prompt = render(tokenizer, example_messages(example)[:-1], add_generation_prompt=True)
            output = model.generate(  # type: ignore[operator]  # transformers types generate oddly
                torch.tensor([prompt]),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            text = str(tokenizer.decode(output[0, len(prompt) :], skip_special_tokens=True))
            correct += text.strip() == example.assistant_content
        accuracy[task] = correct / per_task
    return accuracy


def build_demo_model(
    output: Path,
    *,
    train_seconds: float = 60.0,
    seed: int = 0,
    max_steps: int | None = None,
    min_steps: int = 0,
    eval_per_task: int = 8,
    architecture: str = "llama",
) -> TrainStats:
    """Train and save the demo target into `output`, published by one atomic rename."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # Tiny Adam states drift into subnormal floats, which are very slow on CPU.
    torch.set_flush_denormal(True)
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_config(model_config(tokenizer, architecture))
    log(
        f"vocab {len(tokenizer)} tokens, {sum(p.numel() for p in model.parameters()):,} params, "
        f"{torch.get_num_threads()} threads, {train_seconds:g}s budget"
    )
    stats = train(
        model,
        tokenizer,
        train_seconds=train_seconds,
        seed=seed,
        max_steps=max_steps,
        min_steps=min_steps,
        lr=LEARNING_RATES[architecture],
    )
    # bf16 is what vLLM serves; evaluate after the cast so the check matches serving.
    model = model.to(torch.bfloat16)
    if eval_per_task > 0:
        stats.eval_by_task = evaluate(model, tokenizer, seed=seed, per_task=eval_per_task)
        stats.eval_accuracy = round(sum(stats.eval_by_task.values()) / len(TASKS), 4)
        log(f"greedy exact match {stats.eval_accuracy:.2f} by task {stats.eval_by_task}")
    # Stage next to the output (same filesystem) so the final rename is atomic.
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the published model is not
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ).save_pretrained(staging)
        (staging / "draftsmith_demo.json").write_text(
            json.dumps(
                {"seed": seed, "architecture": architecture, "train_seconds": train_seconds, **asdict(stats)}, indent=2
            )
            + "\n"
        )
        publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"wrote {output}")
    return stats


def publish(staging: Path, output: Path) -> None:
    """Replace `output` by `staging`; an old output is moved aside first, never half-overwritten."""
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
        staging.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(output)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m draftsmith.demo_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command")
    build = commands.add_parser("build", help="train and save the demo target (default)")
    build.add_argument("--output", type=Path, required=True, help="model directory to write")
    build.add_argument(
        "--train-seconds", type=float, default=60.0, help="wall-time budget (0: none, then --max-steps is the budget)"
    )
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--max-steps", type=int, default=None, help="also stop after this many")
    build.add_argument(
        "--min-steps", type=int, default=400, help="train at least this many steps even past the time budget"
    )
    build.add_argument("--eval-per-task", type=int, default=8, help="greedy checks per task after training (0 skips)")
    build.add_argument("--architecture", choices=ARCHITECTURES, default="llama")
    questions = commands.add_parser("questions", help="write the demo question JSONL")
    questions.add_argument("--output", type=Path, required=True)
    questions.add_argument("--count", type=int, default=1200, help="distinct questions")
    questions.add_argument("--duplicates", type=int, default=8, help="exact duplicate rows")
    questions.add_argument("--seed", type=int, default=0)
    # `build` is the default so the workflow's call needs no subcommand.
    if not argv or argv[0] not in ("build", "questions", "-h", "--help"):
        argv = ["build", *argv]
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "questions":
        lines = write_questions(args.output, count=args.count, seed=args.seed, duplicates=args.duplicates)
        log(f"wrote {lines} rows to {args.output}")
        return 0
    build_demo_model(
        args.output,
        train_seconds=args.train_seconds,
        seed=args.seed,
        max_steps=args.max_steps,
        min_steps=args.min_steps,
        eval_per_task=args.eval_per_task,
        architecture=args.architecture,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
