"""Run a command so that it and every process it starts die with the job that started it.

    python -m draftsmith.guard -- COMMAND ARGS...

vLLM's API server starts engine-core and worker processes (renamed ``VLLM::EngineCore``,
``VLLM::Worker``); torchrun starts one worker per GPU. Killing only the top process
orphans the rest, and they keep the GPUs. PR_SET_PDEATHSIG on the top process alone does
not help: it reaches that process, not its children. So the guard leads a process group
of its own, asks the kernel for SIGTERM when its parent (the stage) dies, however it died,
and then stops the whole group: SIGTERM, a grace period, SIGKILL.

One link up, the stage itself dies with the workflow that launched it (``stop_with_launcher``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
GRACE_S = 10.0


# Snakemake sets these to each job's `threads` (1 unless a rule says more). That halved the
# CPU trainer (bench/overhead.py), and a value above the cores vLLM binds made generation
# ten times slower. Servers and trainers get the environment without them, so they size
# their thread pools as when started by hand; server.env can still set them for vLLM.
THREAD_CAPS = (
    "OMP_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


# A rule's `shell:` command runs under a shell of Snakemake's; the launcher is above it.
SHELLS = frozenset({"bash", "sh", "dash", "zsh"})
LAUNCHER_POLL_S = 1.0


def restore_sigint() -> None:
    """`nohup snakemake ... &` starts every job with SIGINT ignored (a shell's background jobs
    are), and an interruption sent to the main thread would then be lost. Restores Python's
    handler; a no-op outside the main thread."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupt_main_thread() -> None:
    """KeyboardInterrupt in the main thread, wherever it is (asyncio.run cancels its tasks on
    it): the stage's ``finally`` blocks stop its servers and trainers."""
    main = threading.main_thread().ident
    assert main is not None  # the main thread is always started
    signal.pthread_kill(main, signal.SIGINT)


def stop_with_launcher(announce) -> None:
    """Interrupt this job when the process that launched it (Snakemake, its SLURM job step, a
    test) dies, calling ``announce(message)`` first.

    Snakemake stops its jobs when interrupted or terminated, but a SIGKILL to Snakemake alone
    (``kill -9``, the OOM killer, a wrapper whose subprocess.run timed out) leaves them running:
    a trainer or a TP=8 server would hold the GPUs for hours, and the rerun would start a
    second one beside it. The kernel has no parent-death signal for a grandparent, so a
    thread polls it. Call from the main thread."""
    import psutil  # here, not at the top: the guard's own start stays light

    launcher = psutil.Process().parent()
    if launcher is not None and launcher.name() in SHELLS:
        launcher = launcher.parent()
    if launcher is None or launcher.pid == 1:
        return  # already orphaned, or started by init: nothing to outlive
    restore_sigint()

    def watch() -> None:
        try:
            while launcher.is_running() and launcher.status() != psutil.STATUS_ZOMBIE:
                time.sleep(LAUNCHER_POLL_S)
        except psutil.NoSuchProcess:
            pass
        announce(
            f"the workflow that launched this job (pid {launcher.pid}) is gone; stopping this job "
            "and its servers and trainers. Finished work is kept: rerun the same command"
        )
        interrupt_main_thread()

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def uncapped_environment(**extra: str) -> dict[str, str]:
    """Our environment without Snakemake's thread caps, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in THREAD_CAPS}, **extra}


def guarded(command: list[str]) -> list[str]:
    """The argv that runs ``command`` under the guard; start it with start_new_session=True."""
    return [sys.executable, "-m", "draftsmith.guard", "--", *command]


def stop_process_group(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """From the job's side: SIGTERM the guarded group, then SIGKILL what is left."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # Engine workers live in the same group and may outlive the top process.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _stop_group(signum=None, frame=None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # we are in the group we signal
    group = os.getpgrp()
    try:
        os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and _group_has_others(group):
            time.sleep(0.2)
    finally:
        os.killpg(group, signal.SIGKILL)  # ends the guard too


def _group_has_others(group: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == group and fields[0] != "Z":
                    return True
            except (OSError, IndexError, ValueError):
                continue
    return False


def main(argv: list[str]) -> int:
    command = argv[1:] if argv[:1] == ["--"] else argv
    parent = os.getppid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGTERM, _stop_group)
    if os.getppid() != parent:  # the parent died before the request took effect
        _stop_group()
    child = subprocess.Popen(command)  # same process group: ours
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
