"""Config schema: both shipped configs validate, bad ones are rejected, every key is documented."""

import copy
import re
from pathlib import Path

import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = str(ROOT / "workflow" / "schemas" / "config.schema.yaml")


def load(name):
    return yaml.safe_load((ROOT / "config" / name).read_text())


def schema_keys(schema, prefix=""):
    """Leaf keys (sections themselves are not table rows)."""
    for key, sub in schema.get("properties", {}).items():
        if "properties" in sub and sub.get("type") == "object":
            yield from schema_keys(sub, f"{prefix}{key}.")
        else:
            yield prefix + key


@pytest.mark.parametrize("name", ["config.yaml", "kimi-k2.5-int4.yaml"])
def test_shipped_configs_validate_and_get_defaults(name):
    config = load(name)
    validate(config, SCHEMA)
    assert config["server"]["data_parallel_size"] == 1  # a default was filled in
    assert "seed" in config["training"]


def test_production_example_matches_the_mission():
    config = load("kimi-k2.5-int4.yaml")
    validate(config, SCHEMA)
    assert config["layers"] == [2, 30, 58, 60]
    assert config["server"]["tensor_parallel_size"] == 8
    assert config["generation"]["concurrency"] == 128
    assert config["generation"]["max_tokens"] == 8192
    assert config["questions"]["source"] == "mlabonne/open-perfectblend"
    assert config["questions"]["limit"] == 10000
    assert config["target"]["model"].startswith("/")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(unknown_key=1), "unknown_key"),
        (lambda c: c["generation"].update(max_tokenz=5), "max_tokenz"),
        (lambda c: c["generation"].update(concurrency="many"), "many"),
        (lambda c: c["questions"].update(shards=0), "minimum"),
        (lambda c: c["server"].update(tensor_parallel_size=-2), "minimum"),
        (lambda c: c.update(layers=[5]), "layers"),
        (lambda c: c["questions"].update(source=""), "source"),
    ],
)
def test_bad_configs_are_rejected(change, message):
    config = copy.deepcopy(load("config.yaml"))
    change(config)
    with pytest.raises(WorkflowError, match=message):
        validate(config, SCHEMA)


def test_every_key_is_documented():
    schema = yaml.safe_load(Path(SCHEMA).read_text())
    readme = (ROOT / "config" / "README.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", readme, flags=re.M))
    assert set(schema_keys(schema)) <= documented
