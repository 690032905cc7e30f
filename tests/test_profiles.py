"""The SLURM profiles name the workflow's rules as they are: a renamed rule silently falls
back to the default resources on a cluster (minutes of runtime and 2 GB for a job that
loads a 1T-parameter target), and on the CPU profile to `--gpus`, which sbatch rejects."""

from pathlib import Path

import pytest
import yaml
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, ResourceSettings

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ["slurm", "slurm-cpu"]


@pytest.fixture(scope="module")
def rules() -> dict[str, dict]:
    """Rule -> {"local": runs on the submit host, "gpu": declares the gpu resource}."""
    with SnakemakeApi() as api:
        workflow = api.workflow(
            resource_settings=ResourceSettings(),
            config_settings=ConfigSettings(),
            snakefile=ROOT / "Snakefile",
            workdir=ROOT,
        )._workflow
        # `localrule: True` lands in this set; Snakemake has no public reader for it.
        local = workflow._localrules | {"all"}
        return {rule.name: {"local": rule.name in local, "gpu": "gpu" in rule.resources} for rule in workflow.rules}


@pytest.mark.parametrize("profile", PROFILES)
def test_every_submitted_rule_is_sized_and_every_sized_rule_exists(profile, rules):
    sized = yaml.safe_load((ROOT / "profiles" / profile / "config.yaml").read_text())["set-resources"]
    assert set(sized) - set(rules) == set(), "set-resources names rules the workflow does not have"
    submitted = {name for name, rule in rules.items() if not rule["local"]}
    assert submitted - set(sized) == set(), "rules submitted to SLURM without their sizes"


def test_the_cpu_profile_asks_no_gpus(rules):
    sized = yaml.safe_load((ROOT / "profiles/slurm-cpu/config.yaml").read_text())["set-resources"]
    wants_gpus = {name for name, rule in rules.items() if rule["gpu"]}
    assert {name for name in wants_gpus if sized.get(name, {}).get("gpu") != 0} == set()
