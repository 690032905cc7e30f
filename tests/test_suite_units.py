"""How `make test` splits the suite between its two processes (conftest.py): a module that
uses the finished demo runs in that demo's unit, or a second process would build it again."""

import ast
from pathlib import Path

from conftest import SHARED_UNITS, unit_of

TESTS = Path(__file__).resolve().parent


def uses_fixture(module: Path, fixture: str) -> bool:
    """Whether a function of the module (a test or a fixture) asks for `fixture`."""
    tree = ast.parse(module.read_text())
    functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
    return any(fixture in {arg.arg for arg in function.args.args} for function in functions)


def test_every_module_on_the_finished_demo_shares_its_unit():
    users = {module.name for module in TESTS.glob("test_*.py") if uses_fixture(module, "demo_run")}
    assert users == {module for module, unit in SHARED_UNITS.items() if unit == "the finished demo"}


def test_a_module_is_its_own_unit_unless_it_shares_one():
    assert unit_of("tests/test_train.py::test_trains_on_cpu_and_publishes_drafter") == "tests/test_train.py"
    assert unit_of("tests/test_workflow.py::test_forced_reruns_reuse_finished_work") == "the finished demo"
    assert unit_of("tests/test_real_model.py") == unit_of("tests/test_gguf_target.py::test_x[1]")
