"""The vLLM plugin that forks the CPU build's engine core instead of spawning it
(draftsmith.vllm_cpu_fork). A real server started this way is test_server.py's first test;
the start time it saves is measured in bench/server_start.py."""

from importlib.metadata import entry_points

import pytest

from draftsmith import vllm_cpu_fork


def test_vllm_finds_the_plugin_through_the_installed_entry_point():
    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins.get("draftsmith_cpu_fork") == "draftsmith.vllm_cpu_fork:register"


@pytest.mark.parametrize(
    ("multiprocessing", "threads", "forks"),
    [
        ("0", "1", True),  # draftsmith's server on 2 cores: the engine core is the only child
        ("0", "3", False),  # libgomp's thread pool would not survive the fork
        ("0", None, False),
        ("1", "1", False),  # vLLM's own worker processes bind their threads: spawn
        (None, "1", False),
    ],
)
def test_only_a_single_threaded_in_process_engine_is_forked(monkeypatch, multiprocessing, threads, forks):
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing), ("OMP_NUM_THREADS", threads)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert vllm_cpu_fork.forks_engine() is forks
