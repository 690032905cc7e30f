"""Entry-point wrapper: a user error ends as one clear last line, with the traceback above it."""

from __future__ import annotations

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
