"""Run-time check of the GPU slot a heavy job was granted.

Snakemake silently scales a `resources: gpu=N` request down to what
`--resources gpu=M` offers, so a TP=8 server could start on a 4-GPU grant.
Each heavy job compares what it got with what its server needs before it
loads anything.
"""

from __future__ import annotations

import os

from draftsmith.errors import DraftsmithError


class GpuSlotError(DraftsmithError):
    pass


def gpus_needed(settings: dict) -> int:
    server = settings["server"]
    return server["tensor_parallel_size"] * server["data_parallel_size"]


def check_gpu_slot(settings: dict, granted: int | None) -> None:
    """Fail with the fix when the grant (or the visible GPUs) cannot hold TP x DP."""
    if settings["device"] != "cuda":
        return  # CPU ranks are threads of this host, not a scheduled resource
    needed = gpus_needed(settings)
    if granted is not None and granted < needed:
        raise GpuSlotError(
            f"this job was granted {granted} GPU(s) but TP x DP = {needed}; run snakemake with "
            f"--resources gpu={max(needed, settings['gpu_slot'])} (or lower server.tensor_parallel_size)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([d for d in visible.split(",") if d.strip()]) < needed:
        raise GpuSlotError(
            f"CUDA_VISIBLE_DEVICES={visible!r} shows fewer than the {needed} GPUs TP x DP needs; "
            "widen CUDA_VISIBLE_DEVICES or lower server.tensor_parallel_size"
        )
