"""Entry points: reading the settings, and a user error ending as one clear last line."""

from __future__ import annotations

import argparse
import errno
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.guard import stop_with_launcher
from draftsmith.progress import log
from draftsmith.run_config import RunConfig
from draftsmith.settings import stage_view

SETTINGS_HELP = "the config as JSON text, or the path of a JSON file (the run's results/.staging/config.json)"


def stage_parser(doc: str | None) -> argparse.ArgumentParser:
    """A stage's command line: described by its docstring's first line, with ``--settings``."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--settings", required=True, help=SETTINGS_HELP)
    return parser


def read_config(value: str) -> dict[str, Any]:
    """``--settings``: JSON text, or the path of the run config the workflow writes."""
    return json.loads(value if value.lstrip().startswith("{") else Path(value).read_text())


def read_settings(value: str, stage: str) -> RunConfig:
    """The config as the stage's rule declares it (draftsmith/settings.py), typed: reading a key
    the rule does not declare is an error."""
    return RunConfig.from_dict(stage_view(read_config(value), stage))


def run_main(main: Callable[[], None]) -> None:
    stop_with_launcher(lambda message: log(f"ERROR: {message}"))
    try:
        main()
    except DraftsmithError as error:
        # The traceback stays in the rule's log for whoever debugs; the last line says what to do.
        traceback.print_exc(file=sys.stderr)
        log(f"ERROR: {error}")
        sys.exit(2)
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        traceback.print_exc(file=sys.stderr)
        where = f" writing {error.filename}" if error.filename else ""
        log(
            f"ERROR: no space left on device{where}: free space on the filesystem of results_dir "
            "(df -h shows it), then rerun the same command; finished work is kept"
        )
        sys.exit(2)
