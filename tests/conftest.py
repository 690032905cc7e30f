"""Shared fixtures: the demo target model, built once per test session."""

import json
import os
import platform
import shutil
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What a copy of the workflow needs to run (envs/: rules record their conda file in metadata).
WORKFLOW_FILES = ("Snakefile", "workflow", "config", "profiles", "envs")


def copy_workflow(workdir: Path) -> Path:
    """A private copy of the workflow, so a test's results never touch the repository."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, workdir / name)
    return workdir


# vLLM on a small CPU box: a 1 GiB KV cache, no hub access. Set before anything imports
# huggingface_hub (which reads HF_HUB_OFFLINE once, at import), so the suite's own
# process is offline too, not only the servers it starts.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
os.environ.update(VLLM_ENV)
# Every process this test session starts inherits this mark, servers and trainers included.
# It, not a process group, is how the tests find their own processes: each server and
# trainer runs in a session of its own (so that its guard can stop the whole group), and a
# second suite running on the machine must not count as ours.
SESSION_MARK = f"DRAFTSMITH_TEST_SESSION={uuid.uuid4().hex}"
os.environ.update([SESSION_MARK.split("=")])


# The fast tier (`make test-fast`) is every test not marked slow. A test is slow when it
# starts vLLM (vllm), runs the workflow (e2e, slurm), runs the real trainer (training) or
# needs the 400-step demo target (the demo_target fixture); the rest run in seconds.
SLOW_MARKERS = {"vllm", "e2e", "slurm", "training"}
SLOW_FIXTURES = {"demo_target"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        marked = {mark.name for mark in item.iter_markers()}
        if marked & SLOW_MARKERS or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# Where the whole suite's time goes, written by every run of the whole suite (`make test`, CI):
# each test's setup + call + teardown seconds, slowest first. A module fixture's cost (an e2e
# run) lands on the first test that uses it.
SUITE_DURATIONS = ROOT / "bench/results/suite_durations.json"
_durations: dict[str, float] = {}
_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or report.outcome != "passed":
        _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.markexpr
    if not whole_suite or config.option.keyword or not _durations:
        return
    tests = sorted(_durations.items(), key=lambda item: -item[1])
    SUITE_DURATIONS.write_text(
        json.dumps(
            {
                "total_s": round(sum(_durations.values()), 1),
                "tests": len(tests),
                "exit_status": int(exitstatus),
                "machine": f"{os.cpu_count()} cores, {platform.machine()}",
                "by_module_s": _by_module(tests),
                "slowest_first": [
                    {"test": nodeid, "s": round(seconds, 2), "outcome": _outcomes.get(nodeid, "")}
                    for nodeid, seconds in tests
                ],
            },
            indent=1,
        )
        + "\n"
    )


def _by_module(tests: list[tuple[str, float]]) -> dict[str, float]:
    modules: dict[str, float] = {}
    for nodeid, seconds in tests:
        module = nodeid.split("::", 1)[0]
        modules[module] = round(modules.get(module, 0.0) + seconds, 1)
    return dict(sorted(modules.items(), key=lambda item: -item[1]))


@pytest.fixture(scope="session")
def demo_target(tmp_path_factory) -> Path:
    """The demo's tiny Llama, trained long enough to answer in its synthetic language."""
    path = tmp_path_factory.mktemp("target") / "demo_model"
    from draftsmith.demo_model import build_demo_model  # here: transformers reads the hub setting on import

    build_demo_model(path, train_seconds=0, max_steps=400, seed=0, eval_per_task=0)
    return path


@pytest.fixture
def target(tmp_path) -> Path:
    """The demo target's config.json alone (6 layers, width 128, 226 tokens): what the checks
    before any work read."""
    model = tmp_path / "model"
    model.mkdir()
    config = {"num_hidden_layers": 6, "hidden_size": 128, "num_attention_heads": 2, "vocab_size": 226}
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """A model directory with a tokenizer and a config but no weights: enough for every
    consumer of the tokenizer (prepare-data, the context checks) in a second."""
    from draftsmith.demo_language import build_tokenizer
    from draftsmith.demo_model import model_config

    path = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer = build_tokenizer()  # the demo target's tokenizer and config, without its weights
    tokenizer.save_pretrained(path)
    model_config(tokenizer).save_pretrained(path)
    return path


def server_settings(model: Path, **server) -> dict:
    """The config sections a server-owning stage reads, for a CPU run of `model`."""
    return {
        "device": "cpu",
        "gpu_slot": 1,
        "target": {"model": str(model), "trust_remote_code": False},
        "server": {
            "tensor_parallel_size": 1,
            "data_parallel_size": 1,
            "max_model_len": 512,
            "startup_timeout_s": 300,
            "extra_args": ["--enforce-eager", "--dtype", "bfloat16"],
            "env": dict(VLLM_ENV),
            **server,
        },
        "hidden_states": {
            "disk_budget": "all",
            "stored_dtype": "served",
            "capture": "separate",
            "capture_memory_fraction": 0.5,
        },
    }


# vLLM renames its engine processes (VLLM::EngineCore, VLLM::Worker); match those too.
HEAVY_MARKERS = ("vllm.entrypoints", "VLLM::", "speculators_cpu", "draftsmith.guard")


def heavy_processes() -> list[str]:
    """This test session's servers, engines, trainers and guards alive right now (zombies
    excluded), as "pid: command line"."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if SESSION_MARK.encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z" and any(marker in command for marker in HEAVY_MARKERS):
            found.append(f"{proc.name}: {command}")
    return found


def heavy_processes_after(seconds: float = 20.0) -> list[str]:
    """Heavy processes still alive once the guards had `seconds` to stop their groups."""
    deadline = time.monotonic() + seconds
    while (alive := heavy_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def write_shard_manifest(shard: Path, **fields) -> Path:
    """A shard's manifest (extraction's own record type) with the given fields set."""
    from draftsmith.records import ShardManifest

    defaults = dict(
        items_fingerprint="",
        rows=[0, 0],
        num_rows=0,
        config_layers=[],
        vllm_layer_ids=[],
        num_layers=0,
        hidden_size=0,
        dtype="bfloat16",
        num_tokens=0,
        bytes=0,
    )
    ShardManifest(**(defaults | fields)).write(shard)
    return shard


# The finished demo the end-to-end modules share (one session fixture; imported last, as it
# imports this module's helpers).
from demo_run import demo_run, interrupted_demo  # noqa: E402, F401


def generation_line(id: str, input_ids: list[int] | None = None, loss_mask: list[int] | None = None, **fields) -> str:
    """One line of generation's records (records.GenerationRecord) for a fixture that cares
    about some fields: the counts the others imply (a one-turn answer, its mask's tokens)."""
    from draftsmith.records import GenerationRecord

    input_ids = input_ids if input_ids is not None else [1, 2]
    loss_mask = loss_mask if loss_mask is not None else [0] + [1] * (len(input_ids) - 1)
    implied = {
        "finish_reason": "stop",
        "completion_tokens": sum(loss_mask),
        "prompt_tokens": len(loss_mask) - sum(loss_mask),
    }
    return GenerationRecord(id, input_ids, loss_mask, **(implied | fields)).to_json(published=True) + "\n"
