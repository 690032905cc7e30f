"""The JSON schema Snakemake validates the config with (and fills in its defaults from),
generated from the declarations on the typed config (``run_config.py``).

Written to ``workflow/schemas/config.schema.yaml`` by ``make generated``: the Snakefile and
Snakemake's ``validate`` read a file, and a file shows a reviewer what a change of a
declaration did to the rules a config must follow.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from typing import Any

import yaml

from draftsmith.run_config import REQUIRED, Declaration, RunConfig, Section, declaration

SCHEMA_PATH = "workflow/schemas/config.schema.yaml"
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number"}


def type_schema(hint: Any) -> dict[str, Any]:
    """What a field's type allows, in JSON-schema words."""
    if isinstance(hint, type) and issubclass(hint, Section):
        return section_schema(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        sections = [arg for arg in args if isinstance(arg, type) and issubclass(arg, Section)]
        if sections:  # a section or null (an endpoint): Snakemake would set defaults on a null
            return {**section_schema(sections[0], with_defaults=False), "type": ["object", "null"]}
        members = [type_schema(arg) for arg in args if arg is not types.NoneType]
        names = [member["type"] for member in members] + (["null"] if types.NoneType in args else [])
        return {"type": names}
    if origin in (tuple, list):
        return {"type": "array", "items": type_schema(args[0])}
    if origin is dict:
        return {"type": "object"} | ({} if args[1] is Any else {"additionalProperties": type_schema(args[1])})
    return {"type": _JSON_TYPES[hint]}


def key_schema(hint: Any, declared: Declaration, with_default: bool = True) -> dict[str, Any]:
    """One key: its type's schema, the declaration's constraints over it (a ``oneOf`` replaces
    the type), its default and its meaning."""
    schema = type_schema(hint)
    if "oneOf" in declared.constraints:
        schema.pop("type")
    schema |= declared.constraints
    if with_default and declared.default is not REQUIRED:
        schema["default"] = declared.default
    return schema | {"description": declared.doc}


def section_schema(cls: type[Section], with_defaults: bool = True) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    declared = {f.name: declaration(f) for f in fields(cls) if f.init}
    properties = {name: key_schema(hints[name], decl, with_defaults) for name, decl in declared.items()}
    required = [name for name, decl in declared.items() if decl.default is REQUIRED]
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False}
    return schema | ({"required": required} if required else {}) | {"properties": properties}


def config_schema() -> dict[str, Any]:
    """The whole document: a section is required where a key of it is, else defaults to {}."""
    hints = typing.get_type_hints(RunConfig)
    properties: dict[str, Any] = {}
    for f in fields(RunConfig):
        if not f.init:
            continue
        hint = hints[f.name]
        if isinstance(hint, type) and issubclass(hint, Section):
            section = section_schema(hint)
            properties[f.name] = section if "required" in section else {**section, "default": {}}
        else:
            properties[f.name] = key_schema(hint, declaration(f))
    required = [name for name, spec in properties.items() if "default" not in spec]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "description": "draftsmith configuration (every key is documented in config/README.md)",
        "type": "object",
        "additionalProperties": False,
        "required": required,
        "properties": properties,
    }


def schema_text() -> str:
    header = (
        "# Generated from the declarations in workflow/draftsmith/run_config.py by `make generated`: do not edit.\n"
    )
    return header + yaml.safe_dump(config_schema(), sort_keys=False, allow_unicode=True, width=100)
