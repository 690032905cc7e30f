"""The config against its schema, as one clear line.

Snakemake's ``validate`` fills in the defaults, but reports a problem followed by a dump
of the schema section (dozens of lines) that buries the key at fault. This check runs
first and names the key, the problem and where to read about it.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for


def config_problem(config: dict, schema_path: str | Path) -> str | None:
    schema = yaml.safe_load(Path(schema_path).read_text())
    error = best_match(validator_for(schema)(schema).iter_errors(config))
    if error is None:
        return None
    where = ".".join(map(str, error.absolute_path)) or "top level"
    return f"config {where}: {error.message}; fix it in the config file (every key is described in config/README.md)"
