"""The guard stops a command's whole process tree when the job that started it is SIGKILLed;
servers and trainers run without Snakemake's thread caps."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

from draftsmith import guard

JOB = """
import subprocess, sys, time
from draftsmith.guard import guarded
# A stand-in for vLLM: a top process that starts a child of its own (like VLLM::EngineCore).
tree = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
server = subprocess.Popen(guarded([sys.executable, "-c", tree]), start_new_session=True)
print(server.pid, flush=True)
time.sleep(300)
"""


def group_members(group: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                members.append(int(entry))
    return members


def test_sigkilled_job_takes_the_whole_guarded_tree_with_it():
    job = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True)
    group = int(job.stdout.readline())
    deadline = time.monotonic() + 10
    while len(group_members(group)) < 3:  # guard, top process, its child
        assert time.monotonic() < deadline
        time.sleep(0.1)
    job.send_signal(signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 15
    while group_members(group):
        assert time.monotonic() < deadline, f"left behind: {group_members(group)}"
        time.sleep(0.2)


def test_servers_and_trainers_get_no_thread_caps_from_snakemake(monkeypatch):
    for name in guard.THREAD_CAPS:
        monkeypatch.setenv(name, "1")  # what Snakemake exports to a job without `threads`
    env = guard.uncapped_environment(VLLM_CPU_KVCACHE_SPACE="1")
    assert not set(guard.THREAD_CAPS) & set(env)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["PATH"] == os.environ["PATH"]
    # A cap the config asks for (server.env) still applies.
    assert guard.uncapped_environment(OMP_NUM_THREADS="4")["OMP_NUM_THREADS"] == "4"


def test_the_suite_counts_only_processes_of_its_own_session():
    """heavy_processes() lists what this session started, not a second suite's servers."""
    from conftest import SESSION_MARK, heavy_processes

    script = "import time; time.sleep(30)  # draftsmith.guard"
    ours = subprocess.Popen([sys.executable, "-c", script])
    other_env = {**os.environ, SESSION_MARK.split("=")[0]: "another-suite"}
    other = subprocess.Popen([sys.executable, "-c", script], env=other_env)
    try:
        time.sleep(0.5)
        listed = " ".join(heavy_processes())
        assert f"{ours.pid}:" in listed and f"{other.pid}:" not in listed
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()


WATCHED_JOB = """
import subprocess, sys, time
from draftsmith.server import DeathWatch
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
watch = DeathWatch(server)
try:
    time.sleep(60)  # the stage's work on a server that dies after a second
except KeyboardInterrupt:
    sys.exit(3 if watch.died else 4)
"""


def test_the_death_watch_interrupts_a_job_started_with_sigint_ignored():
    """`nohup snakemake ... &` starts jobs with SIGINT ignored; the watch still interrupts."""
    job = subprocess.run(
        [sys.executable, "-c", WATCHED_JOB],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert job.returncode == 3, job.stderr[-2000:]


# A stage as the workflow runs it: run_main, one guarded server stand-in, then long work.
STAGE = """
import pathlib, subprocess, sys, time
from draftsmith.cli import run_main
from draftsmith.guard import guarded, stop_process_group

def main():
    server = subprocess.Popen(guarded(["sleep", "300"]), start_new_session=True)
    pathlib.Path("pids").write_text(f"{__import__('os').getpid()} {server.pid}")
    try:
        time.sleep(300)
    finally:
        stop_process_group(server)

run_main(main)
"""
SNAKEFILE = f"""
rule job:
    output: "done"
    log: "job.log"
    shell: "{sys.executable} stage.py > {{log}} 2>&1 && touch {{output}}"
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_job_stops_with_its_servers_when_snakemake_alone_is_sigkilled(tmp_path):
    """kill -9 of Snakemake's pid (not its group) orphans its jobs; each stage sees its
    launcher go and stops, and its guard takes the server down with it."""
    (tmp_path / "stage.py").write_text(STAGE)
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    snakemake = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # for the cleanup below only
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pids").exists() or len((tmp_path / "pids").read_text().split()) < 2:
            assert snakemake.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        stage, server = map(int, (tmp_path / "pids").read_text().split())
        snakemake.kill()  # the pid alone, as kill -9 or the OOM killer would
        snakemake.wait()
        deadline = time.monotonic() + 20
        while alive(stage) or group_members(server):
            assert time.monotonic() < deadline, f"left running: stage {alive(stage)}, server {group_members(server)}"
            time.sleep(0.2)
        assert "the workflow that launched this job" in (tmp_path / "job.log").read_text()
        assert not (tmp_path / "done").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(snakemake.pid, signal.SIGKILL)
