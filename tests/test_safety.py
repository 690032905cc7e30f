"""Safety: config values never reach a shell unquoted, remote code is off by default."""

import json
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import copy_workflow

from draftsmith.dataset import prepare_data_command
from draftsmith.run_config import RunConfig
from draftsmith.server import ServerSpec

ROOT = Path(__file__).resolve().parents[1]
NASTY = "model $(touch PWNED) `touch PWNED2`; touch PWNED3 'q\" &"


def test_shell_metacharacters_in_a_model_path_are_harmless(tmp_path):
    """The model path goes through Snakemake's shell rule (quoted with :q) into the stage."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    copy_workflow(workdir)
    model = workdir / NASTY
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840}))
    config = yaml.safe_load((ROOT / "config/kimi-k2.5-int4.yaml").read_text())
    config["target"]["model"] = str(model)
    (workdir / "nasty.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", "plan", "--configfile", "nasty.yaml", "--cores", "1"],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "x 7168 x 2 B" in run.stdout  # the stage read the config.json at that exact path
    assert not list(workdir.glob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))


def test_commands_are_argument_lists_not_shell_strings():
    spec = ServerSpec(model=NASTY)
    assert NASTY in spec.command(8000)  # one argv element, never split or interpreted
    settings = {
        "target": {"model": NASTY, "trust_remote_code": False},
        "dataset": {"seq_length": 16, "min_trainable_tokens": 1},
    }
    assert NASTY in prepare_data_command(RunConfig.from_dict(settings), Path("m.jsonl"), Path("out"))


def test_remote_code_is_not_trusted_unless_the_config_says_so():
    assert "--trust-remote-code" not in ServerSpec(model="m").command(8000)
    assert "--trust-remote-code" in ServerSpec(model="m", trust_remote_code=True).command(8000)
    settings = {
        "target": {"model": "m", "trust_remote_code": False},
        "dataset": {"seq_length": 16, "min_trainable_tokens": 1},
    }
    assert "--trust-remote-code" not in prepare_data_command(RunConfig.from_dict(settings), Path("m.jsonl"), Path("o"))
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    assert schema["properties"]["target"]["properties"]["trust_remote_code"]["default"] is False


def test_secrets_in_config_are_redacted_from_run_metadata():
    from draftsmith.report import run_metadata

    text = run_metadata({"server": {"env": {"HF_TOKEN": "hf_canary123", "VLLM_CPU_KVCACHE_SPACE": 1}}})
    assert "hf_canary123" not in text and "VLLM_CPU_KVCACHE_SPACE" in text
