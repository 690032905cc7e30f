"""Do the capture server and the trainer fit one GPU slot together? An estimate, in seconds.

Under a disk budget the training job runs both on the same GPUs (train.py). Each GPU then
holds the server's share (``hidden_states.capture_memory_fraction``, its
``--gpu-memory-utilization``) and the trainer's, the rest. Estimated per GPU:

- server: the checkpoint's bytes / TP, plus the KV cache of one ``max_model_len`` row
  (MLA's latent is whole on every rank, other attention splits over TP), plus
  ``SERVER_OVERHEAD_GIB`` for activations and the CUDA context;
- trainer: measured at the Kimi example's width on an H200 (bench/results/train_gpu.json,
  peak reserved: 45.2 GiB at 8192 tokens per step, 67.3 at 16384, 116.0 at 32768), a fixed
  part plus a part per token of ``training.total_seq_len``, both taken to grow with the
  target's width (a linear approximation: the activations and the drafter's layer do).

The preflight refuses a split that cannot fit and says which setting to move. Where the
checkpoint has no weight files (a planning machine) or no GPU is visible, it says nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

from draftsmith.run_config import RunConfig
from draftsmith.target import TargetShape

GIB = 2**30
MIB = 2**20
KIMI_WIDTH = 7168
TRAINER_FIXED_BYTES_AT_KIMI = 22.2 * GIB  # fit of the three H200 points above
TRAINER_BYTES_PER_TOKEN_AT_KIMI = 2.88 * MIB
SERVER_OVERHEAD_GIB = 4
KV_BYTES_PER_VALUE = 2  # bf16 KV cache


def checkpoint_bytes(model: str | Path) -> int:
    """Bytes of the target's weight files (0 where only config.json is present)."""
    return sum(path.stat().st_size for path in Path(model).glob("*.safetensors"))


def kv_bytes_per_token(target: TargetShape, tensor_parallel_size: int) -> float:
    """Per GPU: MLA keeps the whole latent (and rope key) on every rank; other attention
    splits its KV heads over TP."""
    layers = target.num_hidden_layers
    if target.mla:
        return target.mla_latent * layers * KV_BYTES_PER_VALUE
    query_heads = target.num_attention_heads or 1
    heads = target.num_key_value_heads or query_heads
    head_dim = target.head_dim or target.hidden_size // query_heads
    return 2 * heads * head_dim * layers * KV_BYTES_PER_VALUE / tensor_parallel_size


def server_bytes(weights: int, target: TargetShape, tensor_parallel_size: int, max_model_len: int) -> float:
    kv = kv_bytes_per_token(target, tensor_parallel_size) * max_model_len
    return weights / tensor_parallel_size + kv + SERVER_OVERHEAD_GIB * GIB


def trainer_bytes(hidden_size: int, total_seq_len: int) -> float:
    scale = hidden_size / KIMI_WIDTH
    return scale * (TRAINER_FIXED_BYTES_AT_KIMI + TRAINER_BYTES_PER_TOKEN_AT_KIMI * total_seq_len)


def largest_total_seq_len(hidden_size: int, available: float) -> int:
    """The most tokens per step the trainer's share holds (0 if not even the fixed part)."""
    scale = hidden_size / KIMI_WIDTH
    tokens = (available / scale - TRAINER_FIXED_BYTES_AT_KIMI) / TRAINER_BYTES_PER_TOKEN_AT_KIMI
    return max(int(tokens) // 1024 * 1024, 0)


def split_problems(settings: RunConfig, target: TargetShape, gpu_bytes: int, weights: int) -> list[str]:
    """One line per share that cannot hold its part, naming the setting to move."""
    fraction = settings.hidden_states.capture_memory_fraction
    tp = settings.server.tensor_parallel_size
    need_server = server_bytes(weights, target, tp, settings.server.max_model_len or 0)
    total_seq_len = settings.training.total_seq_len
    need_trainer = trainer_bytes(target.hidden_size, total_seq_len)
    gib = gpu_bytes / GIB
    server_share = math.ceil(need_server / gpu_bytes * 100) / 100  # the fraction to suggest
    if need_server + need_trainer > gpu_bytes:
        tokens = largest_total_seq_len(target.hidden_size, (1 - server_share) * gpu_bytes)
        fix = (
            f"lower training.total_seq_len to {tokens} and set hidden_states.capture_memory_fraction to "
            f"{server_share:.2f}"
            if tokens
            else 'store every row (hidden_states.disk_budget: "all") or use GPUs with more memory'
        )
        return [
            f"capture server (~{need_server / GIB:.0f} GiB per GPU: weights / TP {tp}, KV cache, overhead) and "
            f"trainer (~{need_trainer / GIB:.0f} GiB at total_seq_len {total_seq_len}) do not fit one "
            f"{gib:.0f} GiB GPU together; {fix}"
        ]
    problems = []
    if need_server > fraction * gpu_bytes:
        problems.append(
            f"the capture server needs ~{need_server / GIB:.0f} GiB per GPU but hidden_states.capture_memory_fraction "
            f"{fraction} gives it {fraction * gib:.0f} GiB; set it to {server_share:.2f} or more"
        )
    if need_trainer > (1 - fraction) * gpu_bytes:
        tokens = largest_total_seq_len(target.hidden_size, (1 - fraction) * gpu_bytes)
        problems.append(
            f"the trainer needs ~{need_trainer / GIB:.0f} GiB per GPU at training.total_seq_len {total_seq_len} but "
            f"the capture server leaves it {(1 - fraction) * gib:.0f} GiB; lower total_seq_len to {tokens} or "
            "hidden_states.capture_memory_fraction"
        )
    return problems
