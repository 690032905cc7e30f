"""The workflow stays lint-clean and formatted: snakemake --lint and snakefmt for the rules,
ruff check and ruff format for the Python, and mypy over the package (enforced in CI
through the suite)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULE_FILES = ["Snakefile", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "workflow/rules").glob("*.smk"))]


def test_snakemake_lint_reports_nothing():
    run = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Lints for" not in run.stdout + run.stderr


def test_rule_files_are_snakefmt_formatted():
    snakefmt = Path(sys.executable).with_name("snakefmt")
    run = subprocess.run([str(snakefmt), "--check", *RULE_FILES], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_python_is_ruff_clean_and_formatted():
    ruff = str(Path(sys.executable).with_name("ruff"))
    for command in ([ruff, "check", "."], [ruff, "format", "--check", "."]):
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr


def test_the_package_type_checks():
    """mypy with pyproject.toml's settings: the package's own annotations must agree."""
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_reading_the_workflow_imports_no_heavy_library():
    """Every Snakemake start (each dry run, each SLURM job) imports what the rule files
    import: torch or transformers there cost about 4 s a start (a module-level import of
    transformers once added minutes to the suite)."""
    rule_files = [ROOT / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))]
    modules = sorted(
        {m for path in rule_files for m in re.findall(r"^\s*from (draftsmith[\w.]*) import", path.read_text(), re.M)}
    )
    assert "draftsmith.question_sources" in modules
    heavy = ("torch", "transformers", "vllm", "datasets", "speculators")
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint([h for h in {heavy!r} if h in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded
