"""The files generated from the config's declarations (``run_config.setting`` and
``settings.DERIVED``): the JSON schema and config/README.md's tables.

    make generated                                # rewrites them
    python -m draftsmith.generated --check        # names the stale ones (tests/test_generated.py)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from draftsmith.config_schema import SCHEMA_PATH, schema_text
from draftsmith.run_config import REQUIRED, declarations
from draftsmith.settings import RULE_ORDER, TABLE_EXTRAS, followers_text, reruns_text, table_setting

ROOT = Path(__file__).resolve().parents[2]
CONFIG_README = "config/README.md"
COMMAND = "make generated"


def default_cell(value: Any) -> str:
    """A default as a config would write it (YAML flow style)."""
    if value is REQUIRED:
        return "required"
    return "`" + yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("\n...\n").strip() + "`"


def _table(header: str, rows: list[list[str]]) -> str:
    columns = header.count("|") - 1
    lines = [header, "|" + "---|" * columns] + ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def keys_table() -> str:
    rows = [[f"`{key}`", default_cell(d.default), reruns_text(key), d.doc] for key, d in declarations().items()]
    return _table("| key | default | re-runs | meaning |", rows)


def derived_table() -> str:
    return _table("| setting | re-runs |", [[f"`{row}`", reruns_text(table_setting(row))] for row in TABLE_EXTRAS])


def followers_table() -> str:
    return _table("| rule | followed by |", [[f"`{rule}`", followers_text(rule)] for rule in RULE_ORDER])


README_BLOCKS: dict[str, Callable[[], str]] = {
    "settings": derived_table,
    "followers": followers_table,
    "keys": keys_table,
}


def readme_text(current: str) -> str:
    """config/README.md with each generated block (between its markers) written anew."""
    for name, table in README_BLOCKS.items():
        begin, end = f"<!-- generated: {name} ({COMMAND}) -->", f"<!-- end generated: {name} -->"
        pattern = re.compile(re.escape(begin) + r"\n.*?\n" + re.escape(end), re.DOTALL)
        if not pattern.search(current):
            raise ValueError(f"{CONFIG_README} has lost its markers {begin} ... {end}")
        current = pattern.sub(f"{begin}\n{table()}\n{end}".replace("\\", "\\\\"), current)
    return current


GENERATED: dict[str, Callable[[str], str]] = {
    SCHEMA_PATH: lambda _current: schema_text(),
    CONFIG_README: readme_text,
}


def stale(root: Path = ROOT) -> list[str]:
    """The generated files that differ from what the declarations make."""
    return [path for path, make in GENERATED.items() if (root / path).read_text() != make((root / path).read_text())]


def write(root: Path = ROOT) -> None:
    for path, make in GENERATED.items():
        (root / path).write_text(make((root / path).read_text()))


def main(argv: list[str] | None = None, root: Path = ROOT) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="name the stale files; write nothing")
    if parser.parse_args(argv).check:
        if found := stale(root):
            sys.exit(f"stale, generated from the config's declarations: {', '.join(found)}; run `{COMMAND}`")
        return
    write(root)


if __name__ == "__main__":
    main()
