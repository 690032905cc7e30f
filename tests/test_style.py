"""The workflow stays lint-clean and formatted: snakemake --lint and snakefmt for the rules,
ruff check and ruff format for the Python, and mypy over the package (enforced in CI
through the suite)."""

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
