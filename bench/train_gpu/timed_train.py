"""The training stage's trainer entry point with a timing probe; bench.py launches it.

    torchrun --standalone --nproc-per-node 1 bench/train_gpu/timed_train.py ARGS...
    # == python -m draftsmith.speculators_cpu train ARGS..., as draftsmith.train runs it

BENCH_RESULT=FILE (required) and BENCH_WARMUP=N (default 3). The probe wraps two
trainer methods and changes nothing they do:
- BatchRecoveryCoordinator.consume (called once per training batch, on the CPU batch):
  counts the batch's real tokens and the attention keys they actually need;
- Trainer._schedulers_step (the last call of an optimizer step): after N warm-up steps
  it synchronizes the GPU once and starts the clock; after --max-steps it synchronizes
  again, writes FILE and exits at once (no checkpoint, no validation pass).
Between the two synchronizations the trainer runs untouched, so the rate includes data
loading, speculators' own per-step synchronizations (log_freq) and the optimizer.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from speculators.train import recovery
from speculators.train import trainer as trainer_module

RESULT = os.environ["BENCH_RESULT"]
WARMUP = int(os.environ.get("BENCH_WARMUP", "3"))
STARTED = time.perf_counter()

CUDA = torch.cuda.is_available()  # False only in a CPU smoke test of this probe
steps: list[dict] = []  # one record per optimizer step: tokens, attention keys, end time
state: dict = {}


def attention_keys(lengths: list[int], window: int | None, ttt_steps: int) -> int:
    """Keys attended by real queries over all TTT steps. Step t attends the causal
    sliding window inside the document (min(p + 1, W) keys at position p) plus the t
    draft tokens of earlier steps at the same position (the diagonal mask)."""
    keys = 0
    for n in lengths:
        w = n if window is None else min(window, n)
        window_keys = w * (w + 1) // 2 + (n - w) * w
        keys += sum(window_keys + t * n for t in range(ttt_steps))
    return keys


def consume(self, batch, *args, **kwargs):
    if self.phase == "training":
        doc = batch["document_ids"].flatten()
        doc = doc[doc >= 0]
        lengths = torch.unique_consecutive(doc, return_counts=True)[1].tolist()
        steps.append(
            {
                "tokens": int(doc.numel()),
                "keys": attention_keys(lengths, state["window"], state["ttt_steps"]),
            }
        )
    return original_consume(self, batch, *args, **kwargs)


def model_shape(trainer) -> dict:
    model = getattr(trainer.model, "module", trainer.model)  # DDP under torchrun
    layer = model.config.transformer_layer_config
    return {
        "hidden": layer.hidden_size,
        "heads": layer.num_attention_heads,
        "kv_heads": layer.num_key_value_heads,
        "head_dim": layer.head_dim,
        "intermediate": layer.intermediate_size,
        "layers": layer.num_hidden_layers,
        "draft_vocab": model.config.draft_vocab_size,
        "aux_layers": len(model.config.eagle_aux_hidden_state_layer_ids),
        "sliding_window": layer.sliding_window if model.sliding_window_indices else None,
        "attn_impl": model._attn_impl,  # noqa: SLF001
    }


def muon_flops_per_step(trainer) -> float:
    """Newton-Schulz FLOPs of torch.optim.Muon per step: for each m x n matrix (m <= n),
    ns_steps x (X X^T: 2m^2 n, A A: 2m^3, B X: 2m^2 n), in bf16."""
    total = 0.0
    for opt in trainer.optimizers:
        if type(opt).__name__ != "Muon":
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                m, n = sorted(p.shape)
                total += group.get("ns_steps", 5) * (4 * m * m * n + 2 * m**3)
    return total


def schedulers_step(self):
    original_schedulers_step(self)
    steps[-1]["end"] = time.perf_counter()
    done = len(steps)
    if done == 1:
        state["first_step_s"] = steps[-1]["end"] - STARTED  # start-up + compile
    if done == WARMUP:
        CUDA and torch.cuda.synchronize()
        state["t0"] = time.perf_counter()
    if done == self.config.max_steps:
        CUDA and torch.cuda.synchronize()
        finish(self, time.perf_counter())


def finish(trainer, t1: float) -> None:
    measured = steps[WARMUP:]
    ends = [state["t0"]] + [s["end"] for s in measured]
    intervals = sorted(b - a for a, b in zip(ends, ends[1:], strict=False))
    result = {
        "warmup_steps": WARMUP,
        "measured_steps": len(measured),
        "seconds": t1 - state["t0"],
        "tokens": sum(s["tokens"] for s in measured),
        "attention_keys": sum(s["keys"] for s in measured),
        "capacity_tokens": len(measured) * trainer.train_loader.collate_fn.max_len,
        "median_step_interval_s": intervals[len(intervals) // 2],
        "first_step_s": state["first_step_s"],
        "peak_allocated_gib": CUDA and torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": CUDA and torch.cuda.max_memory_reserved() / 2**30,
        "muon_flops_per_step": muon_flops_per_step(trainer),
        "shape": model_shape(trainer),
        "ttt_steps": state["ttt_steps"],
    }
    with open(RESULT, "w") as handle:
        json.dump(result, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the checkpoint and validation that follow the last step


def setup_model(self):
    original_setup_model(self)
    shape = model_shape(self)
    state["window"] = shape["sliding_window"]
    state["ttt_steps"] = self.config.train_call_kwargs["ttt_steps"]


original_consume = recovery.BatchRecoveryCoordinator.consume
original_schedulers_step = trainer_module.Trainer._schedulers_step  # noqa: SLF001
original_setup_model = trainer_module.Trainer.setup_model
recovery.BatchRecoveryCoordinator.consume = consume
trainer_module.Trainer._schedulers_step = schedulers_step  # noqa: SLF001
trainer_module.Trainer.setup_model = setup_model

if __name__ == "__main__":
    from draftsmith import speculators_cpu

    sys.argv = ["speculators", "train", *sys.argv[1:]]
    speculators_cpu.main()
