"""The trainer as a supervised process: its output watched for stalls, its failures named.

Under the guard (guard.py), so torchrun's workers are stopped with this job even after a
SIGKILL; a log that stops growing stops it (a worker out of GPU memory can hang instead of
exiting), and the log's tail turns the common failures into a line with the fix.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.errors import TrainError
from draftsmith.guard import guarded, stop_process_group, uncapped_environment
from draftsmith.progress import log, stderr_file
from draftsmith.server import log_tail
from draftsmith.speculators_cpu import METRICS_FILE_ENV


def wait_while_writing(process: subprocess.Popen[bytes], stall_timeout_s: float) -> int:
    """The trainer's exit code; a TrainError if its output stops for ``stall_timeout_s``.

    Seen on the H200: under torchrun a worker that ran out of GPU memory printed its
    traceback and then hung, holding the GPU, instead of exiting. The trainer writes to
    our stderr (the rule's log), so a log that stops growing is the sign. Where stderr
    is not a file (a terminal), there is nothing to watch and we just wait."""
    if not stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode):
        return process.wait()
    last_size, last_change = -1, time.monotonic()
    while True:
        try:
            return process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        size = os.fstat(sys.stderr.fileno()).st_size
        if size != last_size:
            last_size, last_change = size, time.monotonic()
        elif time.monotonic() - last_change > stall_timeout_s:
            raise TrainError(
                f"speculators train wrote nothing for {stall_timeout_s:.0f}s, so it was stopped; a "
                "crashed worker (e.g. out of GPU memory: see the traceback above) can hang instead "
                "of exiting. If it was only slow, raise training.stall_timeout_s"
            )


def run_trainer(command: list[str], metrics_file: Path, stall_timeout_s: float) -> None:
    # Rich wraps log lines at 80 columns when writing to a file; wide lines stay greppable.
    # An extra, so it wins over a COLUMNS the caller's shell exports.
    env = uncapped_environment(COLUMNS="200", **{METRICS_FILE_ENV: str(metrics_file)})
    log("running: " + " ".join(command))
    sys.stderr.flush()
    # Under the guard, so torchrun's workers are stopped with it even after a SIGKILL.
    process = subprocess.Popen(guarded(command), stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        returncode = wait_while_writing(process, stall_timeout_s)
    finally:
        stop_process_group(process)
    if returncode != 0:
        log_path = stderr_file()
        tail = log_tail(log_path, 400) if log_path else ""
        if "OutOfMemoryError" in tail:
            raise TrainError(
                f"speculators train ran out of GPU memory (exit {returncode}); lower "
                "training.total_seq_len (tokens per step) and rerun"
            )
        if "No space left on device" in tail:
            # A capture server or a checkpoint save that found the disk full: the captured
            # files are deleted with this job, the finished epochs are kept.
            raise TrainError(
                f"the disk filled while training (exit {returncode}: captured rows or a checkpoint could not be "
                "written); free space or lower hidden_states.disk_budget, then rerun: training resumes"
            )
        raise TrainError(f"speculators train failed (exit {returncode}); see the log above")
