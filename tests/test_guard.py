"""The guard stops a command's whole process tree when the job that started it is SIGKILLed;
servers and trainers run without Snakemake's thread caps."""

import os
import signal
import subprocess
import sys
import time

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
