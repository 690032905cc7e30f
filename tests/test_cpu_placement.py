"""CPU placement on process trees shaped like a vLLM server (the real one: test_server)."""

import os
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest

from draftsmith.cpu_placement import engine_cores_kept_free, single_process_engine_cores
from draftsmith.server import ServerSpec

ALLOWED = os.sched_getaffinity(0)
pytestmark = pytest.mark.skipif(len(ALLOWED) < 2, reason="placement needs at least 2 cores")

# A parent (the "API server") with one child (the "worker"); both sleep.
TREE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


# The same, its child titled as vLLM titles its engine-core process (prctl PR_SET_NAME).
ENGINE_TREE = TREE.replace(
    "'import time; ",
    "'import ctypes, time; ctypes.CDLL(None).prctl(15, b\\'VLLM::EngineCore\\', 0, 0, 0); ",
)


def start_tree(code: str):
    parent = subprocess.Popen([sys.executable, "-c", code])
    process = psutil.Process(parent.pid)
    deadline = time.monotonic() + 30
    while not process.children():
        assert time.monotonic() < deadline, "the stand-in worker did not start"
        time.sleep(0.01)
    worker = process.children()[0]
    return parent, process, worker


@pytest.fixture
def server_tree():
    parent, process, worker = start_tree(TREE)
    yield process, worker
    worker.kill()
    parent.kill()
    parent.wait()


@pytest.fixture
def engine_tree():
    parent, process, engine_core = start_tree(ENGINE_TREE)
    deadline = time.monotonic() + 30
    while not engine_core.name().startswith("VLLM::"):
        assert time.monotonic() < deadline, "the stand-in engine core did not title itself"
        time.sleep(0.01)
    yield process, engine_core
    engine_core.kill()
    parent.kill()
    parent.wait()


def affinities(process: psutil.Process) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(thread.id)) for thread in process.threads()}


def test_the_frontend_and_this_process_leave_the_engine_its_cores(server_tree):
    api_server, worker = server_tree
    engine = {min(ALLOWED)}
    os.sched_setaffinity(worker.pid, engine)  # what vLLM's OpenMP binding does to a worker
    with engine_cores_kept_free(api_server.pid):
        assert affinities(api_server) == {frozenset(ALLOWED - engine)}
        assert affinities(psutil.Process()) == {frozenset(ALLOWED - engine)}
        assert affinities(worker) == {frozenset(engine)}  # left as vLLM placed it
    assert os.sched_getaffinity(0) == ALLOWED


def test_nothing_is_moved_when_no_core_is_bound(server_tree):
    api_server, worker = server_tree
    with engine_cores_kept_free(api_server.pid):
        assert affinities(api_server) == affinities(worker) == {frozenset(ALLOWED)}
        assert os.sched_getaffinity(0) == ALLOWED


def test_a_single_process_engine_goes_where_the_job_chose(engine_tree):
    """vLLM binds nothing when the worker runs inside the engine-core process: the job puts
    the engine on every core but the last and everything else on the last."""
    api_server, engine_core = engine_tree
    engine = single_process_engine_cores(ALLOWED)
    assert engine == set(sorted(ALLOWED)[:-1])
    with engine_cores_kept_free(api_server.pid, engine):
        assert affinities(engine_core) == {frozenset(engine)}
        assert affinities(api_server) == {frozenset(ALLOWED - engine)}
        assert affinities(psutil.Process()) == {frozenset(ALLOWED - engine)}
    assert os.sched_getaffinity(0) == ALLOWED


def test_one_core_is_left_to_the_engine():
    assert single_process_engine_cores({3}) == {3}


@pytest.mark.parametrize(
    ("changes", "single"),
    [
        ({}, True),
        ({"tensor_parallel_size": 2}, False),  # vLLM's workers, bound by vLLM
        ({"data_parallel_size": 2}, False),
        ({"env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}}, False),  # the user's binding is kept
        ({"env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}, False),
        ({"cpu_device": False}, False),  # a GPU's workers are never folded in
    ],
)
def test_only_one_cpu_rank_without_a_binding_of_the_users_runs_in_one_process(changes, single):
    spec = ServerSpec(model="m", cpu_device=True)
    assert replace(spec, **changes).single_process_engine is single
