"""On a CPU device, keep the cores vLLM binds its engine to for the engine alone.

vLLM's CPU build binds each worker's OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``,
``auto`` by default) and reserves the other cores for everything else, but it does not
pin anything there: the API server and this job's client float, and whenever the
scheduler puts one of them on a bound core it takes turns with the engine. On the 2-core
demo machine that made the same 400 requests run at 42-182 req/s from one repetition to
the next. With the API server and the client on the reserved cores and vLLM's engine-core
process beside its workers: 197-245 req/s (bench/cpu_placement.py). Placement is a
speed-up only, so anything that gets in its way (a process gone, a thread that exited) is
skipped, never fatal.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import psutil

from draftsmith.progress import log

# vLLM titles its engine processes VLLM::EngineCore, VLLM::Worker, ...
ENGINE_PROCESS_PREFIX = "VLLM::"


def single_process_engine_cores(allowed: set[int]) -> set[int]:
    """The cores for an engine that runs its worker in-process: every core but the last,
    the one vLLM's own binding (``auto``) reserves for the API server and the client."""
    return set(sorted(allowed)[:-1]) or set(allowed)


def _thread_ids(process: psutil.Process) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [thread.id for thread in process.threads()]
    return []


def _bound_cores(process: psutil.Process, allowed: set[int]) -> set[int]:
    """The cores of those of its threads bound to fewer than ``allowed``."""
    bound: set[int] = set()
    for thread in _thread_ids(process):
        with contextlib.suppress(OSError):  # the thread may have exited meanwhile
            cores = os.sched_getaffinity(thread)
            if cores < allowed:
                bound |= cores
    return bound


def _pin(threads: Iterable[int], cores: set[int]) -> None:
    for thread in threads:
        with contextlib.suppress(OSError):  # the thread may have exited meanwhile
            os.sched_setaffinity(thread, cores)


def _name(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return process.name()
    return ""


@contextlib.contextmanager
def engine_cores_kept_free(server_pid: int, engine_cores: set[int] | None = None) -> Iterator[None]:
    """Inside the block: the server's frontend processes and this process run on the cores
    the engine is not bound to, its unbound engine processes on the engine's cores.
    ``engine_cores``: where a single-process engine (nothing bound) goes.
    This process gets its own affinity back afterwards."""
    allowed = os.sched_getaffinity(0)
    try:
        root = psutil.Process(server_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        processes = []
    # Per process, the cores its bound threads use: empty except for vLLM's workers.
    bound_by = {process: _bound_cores(process, allowed) for process in processes}
    # A single-process engine binds nothing: its cores are the ones the job chose for it.
    bound = set().union(*bound_by.values()) or set(engine_cores or ())
    frontend = allowed - bound
    if not bound or not frontend:
        log(f"CPU placement: vLLM's engine is bound to {'every' if bound else 'no'} core; left as it is")
        yield
        return
    for process, own_bound in bound_by.items():
        if not own_bound:
            engine = _name(process).startswith(ENGINE_PROCESS_PREFIX)
            _pin(_thread_ids(process), bound if engine else frontend)
    _pin(_thread_ids(psutil.Process()), frontend)
    log(
        f"CPU placement: vLLM's engine on cores {sorted(bound)}, its API server and this "
        f"job's client on {sorted(frontend)}"
    )
    try:
        yield
    finally:
        _pin(_thread_ids(psutil.Process()), allowed)
