"""Run-time check of the GPU slot a heavy job was granted.

Snakemake silently scales a `resources: gpu=N` request down to what
`--resources gpu=M` offers, so a TP=8 server could start on a 4-GPU grant.
Each heavy job compares what it got with what its server needs before it
loads anything.
"""

from __future__ import annotations

import os

from draftsmith.errors import DraftsmithError
from draftsmith.run_config import RunConfig


class GpuSlotError(DraftsmithError):
    pass


def check_gpu_slot(settings: RunConfig, granted: int | None) -> None:
    """Fail with the fix when the grant (or the visible GPUs) cannot hold TP x DP."""
    if not settings.on_cuda:
        return  # CPU ranks are threads of this host, not a scheduled resource
    needed = settings.server.gpus
    if granted is not None and granted < needed:
        raise GpuSlotError(
            f"this job was granted {granted} GPU(s) but TP x DP = {needed}; run snakemake with "
            f"--resources gpu={max(needed, settings.gpu_slot)} (or lower server.tensor_parallel_size)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([d for d in visible.split(",") if d.strip()]) < needed:
        raise GpuSlotError(
            f"CUDA_VISIBLE_DEVICES={visible!r} shows fewer than the {needed} GPUs TP x DP needs; "
            "widen CUDA_VISIBLE_DEVICES or lower server.tensor_parallel_size"
        )
