"""A vLLM plugin that lets the CPU build's AMX attention run: it asks Linux for the AMX state.

On x86, a process may execute AMX tile instructions only after asking the kernel for the
extra register state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``); before that, the
first tile instruction kills it with SIGILL. vLLM 0.32's CPU attention picks its AMX kernel
whenever the CPU reports AMX and the KV cache is bf16 with 32-token blocks, but never asks.
oneDNN asks the first time one of its own AMX matmuls runs, so whether a worker survives
depended on the order of the first shapes it saw: on a Sapphire Rapids host the extraction
server's worker died at its first request (a 2-token prompt) three runs in four, silently,
and the API server then shut down with exit code 0.

``register`` asks once per vLLM process, through torch's own helper (``_init_amx``, the
same request oneDNN makes). It changes nothing on a CPU without AMX, and CUDA never asks.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# How vLLM finds this plugin (pyproject.toml's entry point); the preflight checks it.
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "draftsmith_cpu_amx"
PLUGIN_VALUE = f"{__name__}:register"
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [
    ("torch.cpu", "_is_amx_tile_supported"),
    ("torch._C._cpu", "_init_amx"),
]


def register() -> None:
    """vLLM's plugin hook: on a CPU with AMX, ask for the AMX state before any kernel runs."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch  # here, not at the top: the preflight reads this module's constants only

    if torch.cpu._is_amx_tile_supported() and not torch._C._cpu._init_amx():
        log.warning("draftsmith: the CPU reports AMX but Linux refused its state; vLLM's AMX kernels may crash")
