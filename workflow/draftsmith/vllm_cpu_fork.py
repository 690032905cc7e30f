"""A vLLM plugin that starts the CPU build's single engine process by fork, not spawn.

vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` so that each worker process
starts clean and binds its own OpenMP threads. A spawned process imports vLLM anew: on a
2-core machine that is about 11 s of a server's 26 s start, paid at every model load (a CI
run loads a model about fifty times).

When one CPU rank runs its worker inside the engine-core process on one OpenMP thread
(draftsmith's servers on a 2-core host: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and
``OMP_NUM_THREADS=1``, see ``server.ServerSpec.single_process_engine``), the only process
vLLM starts is that engine core, from an API server that has loaded no model. ``register``
then has the platform choose fork after its own check, the way vLLM starts the engine core
by default on a GPU host: measured, a server answers after 16 s instead of 27 s. With more
OpenMP threads a fork is unsafe (the API server's plugins run OpenMP kernels, and libgomp's
thread pool does not survive a fork: the forked engine hung at its first parallel loop), so
any other setting keeps vLLM's spawn.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# How vLLM finds this plugin (pyproject.toml's entry point); the preflight checks it.
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "draftsmith_cpu_fork"
PLUGIN_VALUE = f"{__name__}:register"
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [("vllm.platforms.cpu", "CpuPlatform")]  # its check_and_update_config is wrapped
FORKING = "starting vLLM's engine core by fork (one OpenMP thread), not spawn: vLLM is imported once"


def forks_engine() -> bool:
    """Whether this server's only child is an in-process-worker engine core on one OpenMP thread."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and os.environ.get("OMP_NUM_THREADS") == "1"


def register() -> None:
    """vLLM's plugin hook: on CPU, fork the engine core when it is the only, single-threaded child."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not forks_engine():
        return
    platform = type(current_platform)
    if getattr(platform, "draftsmith_forks_engine", False):  # vLLM may load plugins twice
        return
    spawning_check = platform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls, vllm_config) -> None:  # noqa: ANN001 (vLLM's own type)
        spawning_check(cls, vllm_config)
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn" and not platform.draftsmith_said_fork:
            log.warning("draftsmith: %s", FORKING)  # once, though vLLM checks the config twice
            platform.draftsmith_said_fork = True
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    platform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]
    platform.draftsmith_forks_engine = True  # type: ignore[attr-defined]
    platform.draftsmith_said_fork = False  # type: ignore[attr-defined]
