"""Log lines that tell the truth under `tail -f`: timestamps, done/total, rate, ETA.

tqdm redraws one line with carriage returns, which a log file turns into noise;
this writes a fresh line at a steady interval instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {message}", file=sys.stderr, flush=True)


def stderr_file() -> Path | None:
    """The file our stderr writes to (the rule's log), if it is a file."""
    with contextlib.suppress(OSError):
        path = Path(os.readlink("/proc/self/fd/2"))
        if path.is_file():
            return path
    return None


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """Counts finished items and logs `done/total, rate, ETA` every ``interval_s``."""

    def __init__(self, label: str, total: int, *, already_done: int = 0, interval_s: float = 10.0):
        self.label = label
        self.total = total
        self.done = already_done
        self.counts: dict[str, int] = {}
        self._session_start_done = already_done
        self._start = time.monotonic()
        self._last = 0.0
        self._interval_s = interval_s
        if already_done:
            log(f"{label}: {already_done}/{total} already done, resuming")

    def advance(self, n: int = 1, **counts: int) -> None:
        self.done += n
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value
        now = time.monotonic()
        if now - self._last >= self._interval_s or self.done >= self.total:
            self._last = now
            log(self.line())

    def line(self) -> str:
        elapsed = time.monotonic() - self._start
        rate = (self.done - self._session_start_done) / elapsed if elapsed > 0 else 0.0
        remaining = self.total - self.done
        eta = format_duration(remaining / rate) if rate > 0 else "?"
        extra = "".join(f", {k} {v}" for k, v in sorted(self.counts.items()))
        percent = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.label}: {self.done}/{self.total} ({percent:.0f}%), {rate:.2f}/s, ETA {eta}{extra}"
