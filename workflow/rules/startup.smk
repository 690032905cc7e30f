# What every start does before any job: the interpreter on PATH, the run config, the preflight.
import os
import sys

# `python` in the rules is the interpreter running Snakemake (the project's venv), even when
# the venv is not activated; under --sdm conda the job's environment comes first instead.
os.environ["PATH"] = os.pathsep.join(
    [os.path.dirname(sys.executable), os.environ["PATH"]]
)


def write_run_config():
    """The validated config, for the jobs of this run (see RUN_CONFIG)."""
    from draftsmith.atomic import atomic_write_text

    atomic_write_text(LAYOUT.run_config, dumps(config) + "\n")


def run_preflight():
    """Stop the run before any job if the environment or config cannot work."""
    import subprocess

    from draftsmith.preflight import default_install_cache

    if set(workflow.dag_settings.targets) == {"plan"}:
        return  # planning runs where nothing heavy will: no GPUs, no disk needed

    command = ["python", "-m", "draftsmith.preflight", "--settings", RUN_CONFIG]
    command += ["--results", RESULTS, "--output", path(LAYOUT.preflight_record)]
    command += ["--install-cache", str(default_install_cache())]
    built = RUN.target.build_demo or RUN.target.gguf
    if built and not os.path.exists(RUN.target.model):
        command.append(
            "--skip-target"
        )  # a rule builds it; its checks run in the rule's jobs
    if not workflow.local_exec:
        command.append(
            "--skip-gpus"
        )  # GPUs live on the compute nodes; each job checks its own
    if subprocess.run(command).returncode != 0:
        raise WorkflowError(
            "preflight failed (problems listed above); nothing was started"
        )
