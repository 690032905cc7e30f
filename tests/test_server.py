"""Managed vLLM server lifecycle with the real vLLM CPU build."""

import json
import os
import shutil
import socket
import urllib.error
import urllib.request

import psutil
import pytest
from conftest import heavy_processes, heavy_processes_after, server_settings

from draftsmith import server, vllm_cpu_bf16, vllm_cpu_fork
from draftsmith.cpu_placement import single_process_engine_cores
from draftsmith.run_config import RunConfig
from draftsmith.server import ServerError, ServerSpec, managed_server

pytestmark = pytest.mark.vllm


def server_processes(port: int) -> list[psutil.Process]:
    """The API server listening on `port` and every process below it."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "--port" in cmdline and str(port) in cmdline:
            found += [proc, *proc.children(recursive=True)]
    return found


def status_of(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as error:
        return error.code


def thread_affinities(process: psutil.Process) -> list[set[int]]:
    return [os.sched_getaffinity(thread.id) for thread in process.threads()]


def assert_engine_cores_kept_free(processes: list[psutil.Process], allowed: set[int]) -> None:
    """One CPU rank runs in vLLM's engine-core process (no worker process): the job pins it
    to every core but the last, and the API server and this (client) process to the last."""
    assert not [p for p in processes if p.name() == "VLLM::Worker"], "the worker runs in the engine core"
    engine = single_process_engine_cores(allowed)  # every core but the last (test_cpu_placement)
    frontend = allowed - engine
    api_server = next(p for p in processes if "--port" in p.cmdline())
    assert all(cores == frontend for cores in thread_affinities(api_server))
    assert all(cores == frontend for cores in thread_affinities(psutil.Process()))
    engine_core = next(p for p in processes if p.name() == "VLLM::EngineCore")
    assert all(cores == engine for cores in thread_affinities(engine_core))
    # Its OpenMP threads are sized to those cores, not to Snakemake's cap nor to the machine,
    # in the environment it inherits from the API server (vLLM's process title overwrites
    # the engine core's own /proc/<pid>/environ).
    environment = api_server.environ()
    assert (environment["OMP_NUM_THREADS"], environment["VLLM_ENABLE_V1_MULTIPROCESSING"]) == (str(len(engine)), "0")


def test_serves_on_loopback_behind_its_key_keeps_engine_cores_free_and_leaves_nothing(
    demo_target, tmp_path, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # Snakemake exports a cap to every job
    spec = ServerSpec.from_config(RunConfig.from_dict(server_settings(demo_target)))
    log_path = tmp_path / "server.log"
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("placement needs at least 2 cores")
    with managed_server(spec, log_path) as endpoint:
        assert endpoint.base_url.startswith("http://127.0.0.1:")
        port = int(endpoint.base_url.rsplit(":", 1)[1].split("/")[0])
        processes = server_processes(port)
        assert processes, "the server process should be visible"
        assert status_of(f"{endpoint.base_url}/models") == 401
        assert status_of(f"{endpoint.base_url}/models", {"Authorization": "Bearer wrong"}) == 401
        assert status_of(f"{endpoint.base_url}/models", endpoint.headers()) == 200
        # Not reachable on another interface: the server binds loopback only.
        listening = {c.laddr.ip for p in processes for c in p.net_connections() if c.status == "LISTEN"}
        assert listening == {"127.0.0.1"}
        assert_engine_cores_kept_free(processes, allowed)
    assert os.sched_getaffinity(0) == allowed  # this process gets its cores back
    gone, alive = psutil.wait_procs(processes, timeout=10)
    assert alive == []
    assert endpoint.api_key not in log_path.read_text()
    # An engine on one core (one OpenMP thread) is forked from the API server, not spawned:
    # vLLM is imported once per start (vllm_cpu_fork), and the engine served as above.
    one_thread = len(single_process_engine_cores(allowed)) == 1
    assert log_path.read_text().count(vllm_cpu_fork.FORKING) == int(one_thread)
    # A bfloat16 target on a CPU without bfloat16 units: its linears run in float32 (vllm_cpu_bf16).
    assert (vllm_cpu_bf16.UPCASTING in log_path.read_text()) != vllm_cpu_bf16.cpu_has_bf16_units()


def test_start_failure_fails_fast_with_the_log_tail(demo_target, tmp_path):
    broken = tmp_path / "broken_model"
    shutil.copytree(demo_target, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["NoSuchArchitectureForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    spec = ServerSpec.from_config(RunConfig.from_dict(server_settings(broken)))
    with pytest.raises(ServerError) as failure:
        with managed_server(spec, tmp_path / "server.log"):
            pytest.fail("a broken model must not come up")
    message = str(failure.value)
    assert "exited with code" in message and "NoSuchArchitectureForCausalLM" in message


def test_load_timeout_stops_the_server(demo_target, tmp_path):
    spec = ServerSpec.from_config(RunConfig.from_dict(server_settings(demo_target, startup_timeout_s=3)))
    before = set(heavy_processes())
    with pytest.raises(ServerError, match="not ready after 3s; raise server.startup_timeout_s"):
        with managed_server(spec, tmp_path / "server.log"):
            pytest.fail("a 3 s budget is too short for vLLM to load")
    assert set(heavy_processes()) - before == set()


def test_a_port_taken_by_another_process_is_named(demo_target, tmp_path, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    # The race free_port() cannot exclude: someone binds the port before vLLM does.
    monkeypatch.setattr(server, "free_port", lambda: port)
    spec = ServerSpec.from_config(RunConfig.from_dict(server_settings(demo_target)))
    with squatter, pytest.raises(ServerError) as failure:
        with managed_server(spec, tmp_path / "server.log"):
            pytest.fail("vLLM cannot serve on a taken port")
    assert str(failure.value) == (
        f"port {port} on 127.0.0.1 was taken by another process before vLLM could bind it; "
        "rerun (each start picks a new free port)"
    )
    assert heavy_processes_after(20) == []
