"""How fast each kind of work goes, for the plan's hours: a table per device, each figure
with its source, replaced by this run's own measurements once its stages have run.

Four rates make a run's wall time: the target's decode (generation), its prefill
(extraction, and the capture server's re-captures while training), the trainer's tokens,
and one model load. Decode and prefill scale with the target's active parameters per token
(``active_parameters``: a MoE counts only its routed top-k and shared experts), so each
figure is stated for the model it was measured on and scaled to the configured target.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.layout import Layout
from draftsmith.records import ShardManifest, read_generation_records

# Our H200 bf16 matmul peak per GPU (bench/results/train_gpu.json: 792 TFLOP/s measured).
H200_MATMUL_FLOPS = 792e12
PREFILL_UTILISATION = 0.25  # the low end of the 25-40% a large MoE prefill reaches at TP=8
SERVER_READY = re.compile(r"server ready at \S+ after (\d+)s")


@dataclass(frozen=True)
class Rate:
    """Work per second of one heavy job's slot, or seconds per model load."""

    value: float
    source: str

    def to_json(self) -> dict[str, Any]:
        return {"value": round(self.value, 3), "source": self.source}


@dataclass(frozen=True)
class Rates:
    decode_tokens_per_s: Rate
    prefill_tokens_per_s: Rate
    train_tokens_per_s: Rate
    load_s: Rate

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name).to_json() for name in self.__dataclass_fields__}


def active_parameters(config: dict[str, Any]) -> float:
    """Weights one token passes through: attention (MLA's low-rank projections where the
    config has them), the dense or routed-top-k-plus-shared MLP of each layer, and the
    output head. Embedding lookups are free. A size the config leaves out takes the usual
    default (an MLP 4x the width, heads of width / heads)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or hidden // heads
    if config.get("kv_lora_rank"):
        nope, rope = config.get("qk_nope_head_dim", head_dim), config.get("qk_rope_head_dim", 0)
        value = config.get("v_head_dim", head_dim)
        q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
        query = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        key_value = hidden * (kv_rank + rope) + kv_rank * heads * (nope + value)
        attention = query + key_value + heads * value * hidden
    else:
        kv_heads = config.get("num_key_value_heads") or heads
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    dense_mlp = 3 * hidden * (config.get("intermediate_size") or 4 * hidden)
    experts = config.get("n_routed_experts") or 0
    dense_layers = min(config.get("first_k_dense_replace", 0), layers) if experts else layers
    per_token_experts = (config.get("num_experts_per_tok") or 0) + (config.get("n_shared_experts") or 0)
    moe_mlp = 3 * hidden * (config.get("moe_intermediate_size") or 0) * per_token_experts
    head = hidden * config.get("vocab_size", 0)
    return float(layers * attention + dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp + head)


# DeepSeek-R1 (the DeepSeek-V3 architecture Kimi-K2.5 shares; 37B active) on one 8xH200
# node, vLLM 0.11 with no tuning: 5,483 tokens/s in all on ShareGPT at high concurrency
# (GPUStack's published H200 performance lab). Decode dominates that mix.
PUBLISHED_DECODE = (5000.0, 37e9, "published: DeepSeek-R1 (37B active) on 8xH200, vLLM 0.11, ShareGPT, ~5.5k tok/s")
# Our H200 trainer at Kimi's drafter shape with the Kimi config's flags (flex attention,
# 32k tokens per step, 4 workers, log every 50): 19,720 tokens/s on one GPU
# (bench/results/train_gpu.md); a slot of 8 trainer processes assumed to scale linearly.
H200_TRAINER_TOKENS_PER_GPU = 19720.0
# Loading Kimi-K2.5 INT4 (540 GB in 64 shards) at TP=8: 22-23 minutes in the hand-run log.
KIMI_LOAD_S = 1380.0
# This machine (2 CPU cores), SmolLM2-135M-Instruct fp32 (bench/results/real_model.json,
# 400 questions): generation 34 answer tokens/s, extraction ~1.9 rows/s of ~300 tokens,
# training 567 tokens/s, a load ~36 s.
CPU_REFERENCE_PARAMS = 135e6
CPU_DECODE, CPU_PREFILL, CPU_TRAIN, CPU_LOAD_S = 34.0, 570.0, 567.0, 36.0


def table_rates(device: str, gpus: int, active: float) -> Rates:
    """The device table's figures, scaled to a target of ``active`` parameters per token."""
    if device == "cpu":
        scale = CPU_REFERENCE_PARAMS / active
        where = "this machine's CPU, SmolLM2-135M (bench/results/real_model.json)"
        return Rates(
            Rate(CPU_DECODE * scale, f"{where}, scaled by active parameters"),
            Rate(CPU_PREFILL * scale, f"{where}, scaled by active parameters"),
            Rate(CPU_TRAIN, f"{where}: the drafter's trainer"),
            Rate(CPU_LOAD_S, where),
        )
    decode, reference, source = PUBLISHED_DECODE
    prefill = PREFILL_UTILISATION * gpus * H200_MATMUL_FLOPS / (2 * active)
    return Rates(
        Rate(decode * gpus / 8 * reference / active, f"{source}; scaled to {gpus} GPUs and the active parameters"),
        Rate(
            prefill,
            f"arithmetic: 2 x {active / 1e9:.1f}B active FLOP per token at {PREFILL_UTILISATION:.0%} of "
            f"{gpus} x 792 TFLOP/s (our H200 matmul peak)",
        ),
        Rate(
            H200_TRAINER_TOKENS_PER_GPU * gpus,
            f"our H200 trainer at Kimi's drafter shape: 19,720 tok/s per GPU x {gpus} (bench/results/train_gpu.md)",
        ),
        Rate(KIMI_LOAD_S, "Kimi-K2.5 INT4 at TP=8: 23 min in the hand-run log"),
    )


def _benchmark_seconds(path: Path) -> float | None:
    """Wall seconds of one job from Snakemake's benchmark file."""
    if not path.is_file():
        return None
    lines = path.read_text().splitlines()
    return float(lines[1].split("\t")[0]) if len(lines) > 1 else None


def _load_seconds(log: Path) -> float | None:
    found = SERVER_READY.findall(log.read_text(errors="replace")) if log.is_file() else []
    return float(found[0]) if found else None


def measured_rates(results: Path, table: Rates, epochs: int) -> Rates:
    """This run's own finished stages in place of the table's figures: generation and
    extraction jobs (benchmark seconds less the load their log reports) and training."""
    layout = Layout(results)
    loads, decode, prefill, train = [], table.decode_tokens_per_s, table.prefill_tokens_per_s, table.train_tokens_per_s
    tokens = seconds = 0.0
    for shard in layout.completion_shards():
        total = _benchmark_seconds(layout.benchmark(f"generate/{shard.stem}"))
        load = _load_seconds(layout.log(f"generate/{shard.stem}"))
        if total is None or load is None:
            continue
        loads.append(load)
        tokens += sum(record.completion_tokens for record in read_generation_records(shard))
        seconds += total - load
    if seconds > 0:
        decode = Rate(tokens / seconds, "measured: this run's generation")
    tokens = seconds = 0.0
    for shard in layout.extracted_shards():
        manifest = ShardManifest.read(shard)
        total = _benchmark_seconds(layout.benchmark(f"extract/{shard.name}"))
        load = _load_seconds(layout.log(f"extract/{shard.name}"))
        if manifest is None or total is None or load is None:
            continue  # no server ran (one pass adopted every row): nothing to time
        loads.append(load)
        tokens += manifest.num_tokens
        seconds += total - load
    if seconds > 0:
        prefill = Rate(tokens / seconds, "measured: this run's extraction")
    train_seconds = _benchmark_seconds(layout.benchmark("train"))
    dataset_tokens = _dataset_tokens(layout)
    if train_seconds and dataset_tokens:
        train = Rate(dataset_tokens * epochs / train_seconds, "measured: this run's training (its startup included)")
    load_rate = Rate(sum(loads) / len(loads), "measured: this run's server loads") if loads else table.load_s
    return Rates(decode, prefill, train, load_rate)


def _dataset_tokens(layout: Layout) -> int | None:
    if not layout.dataset.is_dir():
        return None
    from draftsmith.disk_budget import dataset_row_tokens

    return sum(dataset_row_tokens(layout.dataset))
