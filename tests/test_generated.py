"""The schema and config/README.md's tables are generated from the config's declarations
(run_config.py): a declaration changed without `make generated` fails here, naming the file
and the command."""

import shutil
from pathlib import Path

import jsonschema
import pytest

from draftsmith import generated
from draftsmith.config_schema import config_schema
from draftsmith.run_config import declarations

ROOT = Path(__file__).resolve().parents[1]


def test_the_generated_files_are_what_the_declarations_make():
    assert generated.stale() == [], "generated from run_config.py's declarations: run `make generated`"


def test_a_stale_file_is_named_with_the_command_that_regenerates_it(tmp_path):
    for path in generated.GENERATED:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    generated.main(["--check"], root=tmp_path)  # current: says nothing
    readme = tmp_path / generated.CONFIG_README
    readme.write_text(readme.read_text().replace("| `training.lr` | `0.0001` |", "| `training.lr` | `0.001` |"))
    with pytest.raises(SystemExit, match=r"^stale, .*: config/README.md; run `make generated`$"):
        generated.main(["--check"], root=tmp_path)
    generated.main([], root=tmp_path)
    assert generated.stale(tmp_path) == []
    assert readme.read_text() == (ROOT / generated.CONFIG_README).read_text()


def test_every_declared_default_is_valid_under_its_own_schema():
    """A default outside its own bounds would be filled in by validate and then refused."""
    schema = config_schema()
    for key, declared in declarations().items():
        if declared.default is generated.REQUIRED:
            continue
        node = schema
        for part in key.split("."):
            node = node["properties"][part]
        jsonschema.validate(declared.default, {k: v for k, v in node.items() if k != "default"})
