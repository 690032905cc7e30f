"""The trained drafter, published: the chosen epoch's weights and config for vLLM, and the
per-epoch metrics with where the rows came from (``training_metrics.json``), in one rename."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from draftsmith.atomic import atomic_write_text, publish_directory
from draftsmith.disk_budget import RowSplit
from draftsmith.drafter_kinds import DEFAULT_KIND
from draftsmith.errors import TrainError
from draftsmith.layers import LayerPlan
from draftsmith.layout import DRAFTER_CONFIG, DRAFTER_WEIGHTS, TrainPaths
from draftsmith.progress import log
from draftsmith.records import TrainingMetrics
from draftsmith.server import Endpoint, counter_totals, read_metrics

# The drafter is published in the dtype speculators publishes; its checkpoints are fp32 so that
# a resume is exact (speculators_cpu.lossless_checkpoints), and the dry run saves fp32 on a CPU.
DRAFTER_DTYPE = torch.bfloat16
CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5 writes the first, 4 the second


def write_weights(checkpoint: Path, drafter: Path) -> None:
    weights = load_file(checkpoint / DRAFTER_WEIGHTS)
    converted = {name: t.to(DRAFTER_DTYPE) if t.is_floating_point() else t for name, t in weights.items()}
    save_file(converted, drafter / DRAFTER_WEIGHTS, metadata={"format": "pt"})


# Where each kind's config names the target layers it reads (EAGLE-3 and P-EAGLE, DFlash's).
AUX_LAYER_KEYS = ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")


def stage_drafter(epoch_dir: Path, plan: LayerPlan, drafter: Path, kind: str = DEFAULT_KIND) -> None:
    """Write what vLLM loads, in bf16, with a config that names the aux layers we extracted."""
    drafter.mkdir(parents=True)
    write_weights(epoch_dir, drafter)
    config_path = drafter / DRAFTER_CONFIG
    config = json.loads((epoch_dir / DRAFTER_CONFIG).read_text())
    for key in CONFIG_DTYPE_KEYS:
        if key in config:
            config[key] = str(DRAFTER_DTYPE).removeprefix("torch.")
    model_type = config.get("speculators_model_type")
    if model_type != kind:
        raise TrainError(
            f"{epoch_dir}/config.json has speculators_model_type {model_type!r}, "
            f"expected {kind!r}; check training.extra_args"
        )
    # vLLM captures exactly these ids at serving time: they must be the ones trained on.
    key = next((key for key in AUX_LAYER_KEYS if key in config), AUX_LAYER_KEYS[0])
    if config.get(key) != plan.aux_vllm_ids:
        log(f"setting {key} {config.get(key)} -> {plan.aux_vllm_ids}")
        config[key] = plan.aux_vllm_ids
    atomic_write_text(config_path, json.dumps(config, indent=2) + "\n")


def read_metric_records(metrics_file: Path) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Train records by global step and validation records by epoch; a rerun's records
    (after a resume) replace the ones it repeats."""
    steps: dict[int, dict[str, Any]] = {}
    validations: dict[int, dict[str, Any]] = {}
    if metrics_file.is_file():
        for line in metrics_file.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if "train" in record:
                steps[record["global_step"]] = record
            elif "val" in record:
                validations[record["epoch"]] = record
    return steps, validations


def epoch_metrics(metrics_file: Path) -> list[dict[str, Any]]:
    """Per epoch: the mean of each training metric over its steps, and the validation
    metrics (speculators' ``*_epoch`` names without the suffix)."""
    steps, validations = read_metric_records(metrics_file)
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for record in steps.values():
        by_epoch.setdefault(record["epoch"], []).append(record["train"])
    result = []
    for epoch in sorted(set(by_epoch) | set(validations)):
        train = by_epoch.get(epoch, [])
        result.append(
            {
                "epoch": epoch,
                "steps": len(train),
                "train": {key: sum(step[key] for step in train) / len(train) for key in (train[0] if train else {})},
                "val": {
                    key.removesuffix("_epoch"): value
                    for key, value in validations.get(epoch, {}).get("val", {}).items()
                },
            }
        )
    return result


FINISHED_REQUESTS = "vllm:request_success_total"


def capture_requests(endpoint: Endpoint) -> int:
    """Rows the capture server answered, by its own counter (finished requests)."""
    return counter_totals(read_metrics(endpoint), [FINISHED_REQUESTS])[FINISHED_REQUESTS]


def publish(
    plan: LayerPlan,
    paths: TrainPaths,
    epoch_dir: Path,
    split: RowSplit | None = None,
    capture_requests: int = 0,
    kind: str = DEFAULT_KIND,
    started_from: str | None = None,
    validation_positions: int | None = None,
) -> None:
    """``split``: where the rows came from (stored or captured); ``capture_requests``: the
    requests the capture server answered; ``started_from``: the drafter fine-tuned, in words."""
    partial = paths.staging / "drafter.partial"
    shutil.rmtree(partial, ignore_errors=True)
    stage_drafter(epoch_dir, plan, partial, kind)
    published = int(epoch_dir.name) if epoch_dir.name.isdigit() else None  # None: untrained
    metrics = TrainingMetrics(
        published, epoch_metrics(paths.metrics), started_from=started_from, validation_positions=validation_positions
    )
    if split is not None:
        metrics = dataclasses.replace(
            metrics, rows_stored=split.stored, rows_captured_per_epoch=split.captured, capture_requests=capture_requests
        )
    metrics.write(partial)
    publish_directory(partial, paths.output)
    log(f"published epoch {epoch_dir.name} to {paths.output}")
