"""The package's imports stay a one-way graph: no cycle between its modules (counting the
imports made only for type checking or inside a function, which hide a cycle until a
refactor makes them real), and no stage imports another stage (what two stages share lives
in a module of its own, such as capture_server)."""

import ast
import re
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "workflow" / "draftsmith"
RULE_FILES = [ROOT / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))]


def stage_modules() -> set[str]:
    """The modules the rules run as steps of the workflow: ``python -m draftsmith.<stage>``,
    in a shell command or an argument list. Read from the rules, so a new stage is counted."""
    pattern = re.compile(r"""-m["',\s]+draftsmith\.([a-z_]+)""")
    return {name for path in RULE_FILES for name in pattern.findall(path.read_text())}


def imported_modules(path: Path) -> set[str]:
    """The package's modules that ``path`` imports anywhere: at the top, under TYPE_CHECKING
    or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "draftsmith":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftsmith."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("draftsmith.")}
    return found - {path.stem}


def import_graph() -> dict[str, set[str]]:
    modules = {path.stem: path for path in PACKAGE.glob("*.py")}
    return {name: imported_modules(path) & set(modules) for name, path in sorted(modules.items())}


def a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it (the first one again at the end), if any."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            if cycle := visit(imported, [*path, module]):
                return cycle
        done.add(module)
        return None

    return next((cycle for module in graph if (cycle := visit(module, []))), None)


def test_the_cycle_finder_names_the_modules_along_a_cycle():
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert a_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_has_no_import_cycle():
    cycle = a_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}; move what both need into a module of its own"


def test_the_stages_are_read_from_the_rules():
    stages = stage_modules()
    # The shell form and the argument-list form (the preflight, run at every start).
    assert {"questions", "generate", "train", "evaluate", "evaluation_summary", "preflight"} <= stages
    assert "settings" not in stages and "records" not in stages


def test_no_stage_imports_another_stage():
    graph, stages = import_graph(), stage_modules()
    assert stages <= set(graph), f"stages that are no module of the package: {sorted(stages - set(graph))}"
    crossings = [f"{stage} imports {other}" for stage in sorted(stages) for other in sorted(graph[stage] & stages)]
    assert not crossings, "; ".join(crossings) + ": move what they share into a module of its own"


def test_each_enum_is_written_once_and_its_literal_copies_are_checked():
    """The kinds, free methods and choices are named once (drafter_kinds, run_config) and the
    schema is generated from them; the copies that must stay literals are held to them here."""
    from draftsmith import config_schema, evaluate
    from draftsmith.drafter_kinds import EAGLE3, FREE_METHODS, KINDS
    from draftsmith.run_config import KINDS_WITH_OWN_ARGS

    assert evaluate.SPECULATIVE_METHODS == [KINDS[EAGLE3].serving["method"]]
    training = config_schema.config_schema()["properties"]["training"]["properties"]
    assert training["kinds"]["items"]["enum"] == list(KINDS)
    assert training["kind_args"]["propertyNames"]["enum"] == KINDS_WITH_OWN_ARGS
    evaluation = config_schema.config_schema()["properties"]["evaluation"]["properties"]
    assert evaluation["free_methods"]["items"]["enum"] == list(FREE_METHODS)
    literal = [
        f"{path.name}:{number}"
        for path in PACKAGE.glob("*.py")
        if path.name not in ("drafter_kinds.py", "evaluate.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if '"eagle3"' in line and not line.lstrip().startswith("#")
    ]
    assert literal == [], f"write drafter_kinds.EAGLE3 (or DEFAULT_KIND) instead of the literal: {literal}"
