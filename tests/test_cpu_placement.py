"""CPU placement on process trees shaped like a vLLM server (the real one: test_server)."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from draftsmith.cpu_placement import engine_cores_kept_free

ALLOWED = os.sched_getaffinity(0)
pytestmark = pytest.mark.skipif(len(ALLOWED) < 2, reason="placement needs at least 2 cores")

# A parent (the "API server") with one child (the "worker"); both sleep.
TREE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


@pytest.fixture
def server_tree():
    parent = subprocess.Popen([sys.executable, "-c", TREE])
    process = psutil.Process(parent.pid)
    deadline = time.monotonic() + 30
    while not process.children():
        assert time.monotonic() < deadline, "the stand-in worker did not start"
        time.sleep(0.01)
    worker = process.children()[0]
    yield process, worker
    worker.kill()
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
