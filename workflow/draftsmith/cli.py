"""Entry-point wrapper: a user error ends as one clear last line, with the traceback above it."""

from __future__ import annotations

import errno
import sys
import traceback
from collections.abc import Callable

from draftsmith.errors import DraftsmithError
from draftsmith.progress import log


def run_main(main: Callable[[], None]) -> None:
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
