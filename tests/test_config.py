"""Config schema: both shipped configs validate, bad ones are rejected, every key is documented."""

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from draftsmith.config_check import config_problem, cross_field_problems
from draftsmith.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = str(ROOT / "workflow" / "schemas" / "config.schema.yaml")


def load(name):
    return yaml.safe_load((ROOT / "config" / name).read_text())


def schema_keys(schema, prefix=""):
    """Leaf keys (sections themselves are not table rows)."""
    for key, sub in schema.get("properties", {}).items():
        if "properties" in sub and sub.get("type") == "object":
            yield from schema_keys(sub, f"{prefix}{key}.")
        else:
            yield prefix + key


@pytest.mark.parametrize(
    "name", ["config.yaml", "kimi-k2.5-int4.yaml", "deepseek-v3-tiny.yaml", "smollm2-sharegpt.yaml"]
)
def test_shipped_configs_validate_and_get_defaults(name):
    config = load(name)
    validate(config, SCHEMA)
    assert config["server"]["data_parallel_size"] == 1  # a default was filled in
    assert "seed" in config["training"]
    assert cross_field_problems(RunConfig.from_dict(config)) == []


def test_production_example_matches_the_mission():
    config = load("kimi-k2.5-int4.yaml")
    validate(config, SCHEMA)
    assert config["layers"] == [2, 30, 58, 60]
    assert config["server"]["tensor_parallel_size"] == 8
    assert config["generation"]["concurrency"] == 128
    assert config["generation"]["max_tokens"] == 8192
    assert config["questions"]["source"] == "mlabonne/open-perfectblend"
    assert config["questions"]["limit"] == 10000
    assert config["target"]["model"].startswith("/")


FIX = "; fix it in the config file (every key is described in config/README.md)"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c.update(unknown_key=1),
            "top level: Additional properties are not allowed ('unknown_key' was unexpected)",
        ),
        (
            lambda c: c["generation"].update(max_tokenz=5),
            "generation: Additional properties are not allowed ('max_tokenz' was unexpected)",
        ),
        (
            lambda c: c["generation"].update(concurrency="many"),
            "generation.concurrency: 'many' is not of type 'integer'",
        ),
        (lambda c: c["questions"].update(shards=0), "questions.shards: 0 is less than the minimum of 1"),
        (
            lambda c: c["server"].update(tensor_parallel_size=-2),
            "server.tensor_parallel_size: -2 is less than the minimum of 1",
        ),
        (lambda c: c["training"].update(epochs=0), "training.epochs: 0 is less than the minimum of 1"),
        (lambda c: c["training"].update(lr=0), "training.lr: 0 is less than or equal to the minimum of 0"),
        (
            lambda c: c["generation"].update(max_error_fraction=1.5),
            "generation.max_error_fraction: 1.5 is greater than the maximum of 1",
        ),
        (lambda c: c.update(layers=[5]), "layers: [5] is too short"),
        (lambda c: c.pop("layers"), "top level: 'layers' is a required property"),
        (lambda c: c["questions"].update(source=""), "questions.source: '' should be non-empty"),
    ],
)
def test_bad_configs_get_one_line_naming_the_key(change, message):
    config = copy.deepcopy(load("config.yaml"))
    change(config)
    assert config_problem(config, SCHEMA) == f"config {message}{FIX}"
    with pytest.raises(WorkflowError):  # Snakemake's own validate agrees
        validate(config, SCHEMA)


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            ("  max_tokens: 64", "  max_tokenz: 64"),
            f"config generation: Additional properties are not allowed ('max_tokenz' was unexpected){FIX}",
        ),
        (  # valid alone; with the demo's max_model_len of 512 every request would be refused
            ("  max_tokens: 64", "  max_tokens: 100000"),
            "config generation.max_tokens 100000 is not below server.max_model_len 512: vLLM would refuse "
            "every request (no room for the prompt); lower generation.max_tokens or raise server.max_model_len",
        ),
    ],
)
def test_snakemake_reports_a_bad_config_in_one_line_without_the_schema(change, expected, tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    text = (workdir / "config/config.yaml").read_text()
    assert text.index(change[0]) < text.index("evaluation:")  # generation's, the first
    (workdir / "config/config.yaml").write_text(text.replace(*change, 1))
    run = subprocess.run([sys.executable, "-m", "snakemake", "-n"], cwd=workdir, capture_output=True, text=True)
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert expected in output.splitlines(), output
    assert "Failed validating" not in output  # no schema dump


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda c: c["generation"].update(max_tokens=512), "generation.max_tokens 512 is not below"),
        (lambda c: c["evaluation"].update(max_tokens=4096), "evaluation.max_tokens 4096 is not below"),
        (lambda c: c["dataset"].update(seq_length=600), "max_model_len 512 is below dataset.seq_length + 1 = 601"),
        (lambda c: c["training"].update(kinds=["dflash"]), "training.kinds ['dflash'] lacks eagle3"),
        # What vLLM 0.32's CPU build cannot serve is refused on a CPU, with vLLM's reason.
        (
            lambda c: c["training"].update(kinds=["eagle3", "dspark"]),
            "dspark is served only on cuda by vLLM 0.32 (vLLM's V1 model runner refuses",
        ),
        (
            lambda c: c["training"].update(kinds=["eagle3", "xpress"]),
            "xpress is served on no device by vLLM 0.32 (vLLM 0.32 has no speculative method",
        ),
    ],
)
def test_settings_that_cannot_work_together_are_named(change, problem):
    config = copy.deepcopy(load("config.yaml"))
    validate(config, SCHEMA)  # fills in the defaults, as the Snakefile does first
    assert cross_field_problems(RunConfig.from_dict(config)) == []
    change(config)
    (found,) = cross_field_problems(RunConfig.from_dict(config))
    assert problem in found and found.startswith("config ") and "\n" not in found


def test_every_key_is_documented():
    schema = yaml.safe_load(Path(SCHEMA).read_text())
    readme = (ROOT / "config" / "README.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", readme, flags=re.M))
    assert set(schema_keys(schema)) <= documented


def test_each_kind_is_refused_exactly_where_vllm_cannot_serve_it():
    """On a CPU: eagle3, dflash and peagle plan; dflash2 and dspark only on CUDA; xpress and
    mtp nowhere. Each refusal names the kinds that the device does serve."""
    config = copy.deepcopy(load("config.yaml"))
    validate(config, SCHEMA)
    refused = {}
    for device in ("cpu", "cuda"):
        for kind in ("dflash", "peagle", "dflash2", "dspark", "xpress", "mtp"):
            changed = copy.deepcopy(config)
            changed.update(device=device)
            changed["training"]["kinds"] = ["eagle3", kind]
            problems = cross_field_problems(RunConfig.from_dict(changed))
            if problems:
                (refused[device, kind],) = problems
    assert sorted(refused) == [
        ("cpu", "dflash2"),
        ("cpu", "dspark"),
        ("cpu", "mtp"),
        ("cpu", "xpress"),
        ("cuda", "mtp"),
        ("cuda", "xpress"),
    ]
    assert refused["cpu", "dspark"].endswith("on device cpu use dflash, eagle3, peagle")
    assert refused["cuda", "xpress"].endswith("on device cuda use dflash, dflash2, dspark, eagle3, peagle")


def test_the_dry_run_refuses_a_kind_the_device_cannot_serve_and_plans_it_on_cuda(tmp_path):
    """In seconds, before any job: DSpark has no CPU path in vLLM 0.32; on CUDA it plans."""
    workdir = copy_workflow(tmp_path / "wf")
    config = workdir / "config/config.yaml"
    config.write_text(config.read_text().replace("  extra_args: []", "  extra_args: []\n  kinds: [eagle3, dspark]", 1))
    refused = subprocess.run([sys.executable, "-m", "snakemake", "-n"], cwd=workdir, capture_output=True, text=True)
    assert refused.returncode != 0
    (line,) = [line for line in (refused.stdout + refused.stderr).splitlines() if "training.kinds" in line]
    assert line.startswith("config training.kinds: dspark is served only on cuda by vLLM 0.32 (")
    assert line.endswith("on device cpu use dflash, eagle3, peagle")
    config.write_text(config.read_text().replace("device: cpu", "device: cuda", 1))
    planned = subprocess.run([sys.executable, "-m", "snakemake", "-n"], cwd=workdir, capture_output=True, text=True)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "train_kind" in planned.stdout and "evaluate_kind" in planned.stdout


def test_the_schema_offers_exactly_the_drafter_kinds_and_free_methods_the_code_knows():
    """drafter_kinds.py owns both lists: a name only in the schema would validate, then fail
    deep in a job with a KeyError; one only in the code could never be configured."""
    from draftsmith.drafter_kinds import FREE_METHODS, KINDS

    schema = yaml.safe_load(Path(SCHEMA).read_text())["properties"]
    assert schema["training"]["properties"]["kinds"]["items"]["enum"] == list(KINDS)
    assert schema["evaluation"]["properties"]["free_methods"]["items"]["enum"] == list(FREE_METHODS)


def readme_config(heading: str) -> dict:
    """The first YAML block after a README heading: what a user copies."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(f"## {heading}\n") :]
    return yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])


def test_the_readmes_my_model_config_is_a_valid_config():
    config = readme_config("Your model, your questions")
    assert config_problem(copy.deepcopy(config), SCHEMA) is None
    validate(config, SCHEMA)
    run = RunConfig.from_dict(config)
    assert cross_field_problems(run) == []
    assert (run.device, run.gpu_slot, run.server.gpus) == ("cuda", 8, 8)


def test_the_readmes_from_pretrained_example_is_a_valid_training_section():
    config = readme_config("Your model, your questions") | readme_config("Start from a published drafter")
    validate(config, SCHEMA)
    assert RunConfig.from_dict(config).training.from_pretrained == "/models/Kimi-K2.5-eagle3"
