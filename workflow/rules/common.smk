# Paths, tracked settings and input functions shared by the rule files.
import os
import shlex
import sys

from draftsmith.layout import Layout
from draftsmith.questions import is_local_source
from draftsmith.settings import dumps, tracked_settings

# `python` in the rules is the interpreter running Snakemake (the project's venv), even when
# the venv is not activated; under --sdm conda the job's environment comes first instead.
os.environ["PATH"] = os.pathsep.join(
    [os.path.dirname(sys.executable), os.environ["PATH"]]
)
LAYOUT = Layout(config["results_dir"])
RESULTS = str(LAYOUT.results)
# Every job reads the whole config from this file (written at each start), and sees only
# the keys its rule declares in draftsmith/settings.py; params carry what is tracked.
RUN_CONFIG = str(LAYOUT.run_config)
# For `--sdm conda`; relative to the rule files.
CONDA_ENV = f"../../envs/{'cpu' if config['device'] == 'cpu' else 'gpu'}.yaml"

QUESTION_SHARDS = list(range(config["questions"]["shards"]))
EXTRACTION_SHARDS = list(range(config["extraction"]["shards"]))


def path(location):
    return str(location)


def log_path(name):
    return str(LAYOUT.log(name))


def staging(stage, shard=None):
    return str(LAYOUT.staging_for(stage, shard))


def tracked(rule):
    """The rule's params: the settings that shape its output (draftsmith/settings.py)."""
    return dumps(tracked_settings(config, rule))


def target_model_input():
    """The demo's target is built by a rule; a production target is a path we only read."""
    return [config["target"]["model"]] if config["target"]["build_demo"] else []


def questions_source_input():
    """A local question file is an input (editing it re-runs); a hub id is not a file."""
    source = config["questions"]["source"]
    return [source] if is_local_source(source) else []


def completion_shards():
    return [path(LAYOUT.completion_shard(shard)) for shard in QUESTION_SHARDS]


def extraction_shards():
    return [path(LAYOUT.hidden_state_shard(shard)) for shard in EXTRACTION_SHARDS]


def untrained_drafter_input():
    if config["evaluation"]["compare_untrained"]:
        return [path(LAYOUT.untrained_drafter)]
    return []


def final_outputs():
    return [
        path(LAYOUT.acceptance),
        path(LAYOUT.plan_json),
        path(LAYOUT.report_file("completion_lengths.png")),
        path(LAYOUT.report_file("training_curves.png")),
        path(LAYOUT.report_file("run_metadata.txt")),
    ]


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
    if config["target"]["build_demo"] and not os.path.exists(config["target"]["model"]):
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
