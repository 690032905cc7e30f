"""The typed run config (draftsmith/run_config.py): the schema and the fields name the same keys
with the same types, every shipped config builds, and a job reading a key its rule does not
declare is stopped with the key's name."""

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from draftsmith.run_config import RunConfig, Section, UndeclaredSetting, field_keys
from draftsmith.settings import STAGES, schema_keys, stage_view

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "workflow/schemas/config.schema.yaml"
SCHEMA = yaml.safe_load(SCHEMA_PATH.read_text())
CONFIGS = sorted((ROOT / "config").glob("*.yaml"))

# The schema's JSON types and the Python types a field may hold for them.
JSON_TYPES = {"integer": {int}, "number": {float, int}, "string": {str}, "boolean": {bool}, "null": {type(None)}}


def validated(path: Path) -> dict:
    config = yaml.safe_load(path.read_text())
    validate(config, str(SCHEMA_PATH))
    return config


def schema_spec(key: str) -> dict:
    spec = SCHEMA
    for part in key.split("."):
        spec = spec["properties"][part]
    return spec


def json_types(spec: dict) -> set[str]:
    """The JSON types a schema entry allows (through $ref and oneOf)."""
    if "$ref" in spec:
        return json_types(SCHEMA["definitions"][spec["$ref"].split("/")[-1]])
    if "oneOf" in spec:
        return set().union(*(json_types(option) for option in spec["oneOf"]))
    if "enum" in spec and "type" not in spec:
        return {type(value).__name__.replace("str", "string") for value in spec["enum"]}
    kinds = spec["type"]
    return set(kinds) if isinstance(kinds, list) else {kinds}


def field_hint(key: str):
    cls: type = RunConfig
    *sections, name = key.split(".")
    for part in sections:
        cls = typing.get_type_hints(cls)[part]
    return typing.get_type_hints(cls)[name]


def python_types(hint) -> set[type]:
    if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType):
        return set().union(*(python_types(arg) for arg in typing.get_args(hint)))
    origin = typing.get_origin(hint) or hint
    return {origin}


def test_the_fields_are_the_schemas_keys():
    """Adding a key to one and not the other fails here (one field edit plus its schema entry)."""
    assert field_keys() == schema_keys(SCHEMA_PATH)


@pytest.mark.parametrize("key", schema_keys(SCHEMA_PATH))
def test_each_field_holds_the_type_the_schema_allows(key):
    allowed = python_types(field_hint(key))
    for kind in json_types(schema_spec(key)):
        if kind == "array":
            assert allowed & {tuple, list}, f"{key}: the schema allows a list, the field {allowed}"
        elif kind == "object":
            assert allowed & {dict} or any(isinstance(t, type) and issubclass(t, Section) for t in allowed), key
        else:
            assert JSON_TYPES[kind] & allowed, f"{key}: the schema allows {kind}, the field {allowed}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_builds_whole(path):
    config = validated(path)
    run = RunConfig.from_dict(config)
    for key in field_keys():
        value = run
        for part in key.split("."):
            value = getattr(value, part)  # none is undeclared in a whole config
    assert run.source is config
    assert isinstance(run.layers, tuple) and list(run.layers) == config["layers"]
    assert run.server.gpus == config["server"]["tensor_parallel_size"] * config["server"]["data_parallel_size"]


def test_the_demo_config_reads_as_typed_values():
    run = RunConfig.from_dict(validated(ROOT / "config/config.yaml"))
    assert run.evaluation.draft_lengths == [3, 1] and run.evaluation.concurrencies == [8, 4]
    assert run.hidden_states.limited_budget is None and not run.hidden_states.fp8
    assert run.trainer_processes == 1  # a CPU run trains in one process whatever gpu_slot says
    deepseek = RunConfig.from_dict(validated(ROOT / "config/deepseek-v3-tiny.yaml"))
    assert deepseek.hidden_states.fp8 and deepseek.hidden_states.limited_budget == 14_500_000


def test_an_evaluation_set_gets_the_defaults_the_schema_cannot_fill_in():
    """Snakemake's validate fills in defaults of named properties only, not of each set."""
    run = RunConfig.from_dict({"evaluation": {"sets": {"gsm8k": {"source": "openai/gsm8k"}}}})
    gsm8k = run.evaluation.sets["gsm8k"]
    assert (gsm8k.source, gsm8k.split, gsm8k.subset, gsm8k.limit, gsm8k.prompt_field) == (
        "openai/gsm8k",
        "train",
        None,
        None,
        None,
    )


@pytest.mark.parametrize("rule", sorted(STAGES))
def test_a_job_reads_what_its_rule_declares_and_nothing_else(rule):
    """Every declared key reads through the typed view; an undeclared one stops the job with
    its name and where to declare it."""
    config = validated(ROOT / "config/config.yaml")
    view = RunConfig.from_dict(stage_view(config, rule))
    declared = set(stage_view(config, rule))
    for key in field_keys():
        section = key.split(".")[0]
        parent, name = view, key
        if "." in key:
            if section not in declared:
                continue
            parent, name = getattr(view, section), key.split(".", 1)[1]
        if key in _flattened(stage_view(config, rule)):
            getattr(parent, name)
        else:
            with pytest.raises(
                UndeclaredSetting, match=rf"^{key.replace('.', '[.]')} is not among .*/run_config[.]py$"
            ):
                getattr(parent, name)


def _flattened(view: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in view.items():
        if isinstance(value, dict) and name in {f.name for f in dataclasses.fields(RunConfig)} and not prefix:
            keys |= _flattened(value, f"{name}.")
        else:
            keys.add(prefix + name)
    return keys


def test_an_undeclared_setting_is_a_key_error_so_partial_lookups_still_work():
    """settings.item_settings treats a key a partial config leaves out as None (KeyError)."""
    assert issubclass(UndeclaredSetting, KeyError)
    view = RunConfig.from_dict({"device": "cpu"})
    with pytest.raises(KeyError):
        getattr(view, "gpu_slot")  # noqa: B009 (the read itself is what is tested)
    assert "gpu_slot=<undeclared>" in repr(view) and view.device == "cpu"
