"""The single source of truth for what a change re-runs (draftsmith/settings.py): every key is
decided, the README says what the code says, the DAG copy matches Snakemake's, and a stage
sees only the keys its rule accounts for."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow
from snakemake.utils import validate

from draftsmith import settings
from draftsmith.disk_budget import served_dtype
from draftsmith.run_config import RunConfig, declarations
from draftsmith.settings import (
    CONSUMERS,
    EVERYTHING,
    RULE_ORDER,
    STAGES,
    TABLE_EXTRAS,
    WHERE,
    config_keys,
    followers_text,
    reruns_text,
    schema_keys,
    stage_view,
    table_setting,
    tracked_settings,
)

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow/schemas/config.schema.yaml"
README = ROOT / "config/README.md"


def demo_config() -> dict:
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    validate(config, str(SCHEMA))
    return config


def declared_config_keys() -> set[str]:
    keys = set(WHERE)
    for stage in STAGES.values():
        for setting in stage.shaping + stage.extent + stage.operational:
            keys.update(config_keys(setting))
    return keys


def test_every_key_of_the_schema_is_decided_by_some_stage():
    undecided = [
        key
        for key in schema_keys(SCHEMA)
        if key not in declared_config_keys() and key.split(".")[0] not in declared_config_keys()
    ]
    assert undecided == []


def test_declared_settings_are_keys_of_the_schema():
    keys = set(schema_keys(SCHEMA))
    for setting in declared_config_keys() - set(EVERYTHING):
        assert setting in keys or any(key.startswith(setting + ".") for key in keys), setting


def readme_cells(header: str) -> dict[str, list[str]]:
    """First-column name -> the other cells, for the table under the given header row."""
    rows, inside = {}, False
    for line in README.read_text().splitlines():
        if line.startswith(header):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_readme_rerun_column_is_the_code_decision():
    keys = readme_cells("| key | default | re-runs | meaning |")
    assert sorted(keys) == sorted(schema_keys(SCHEMA))
    for key, (_default, reruns, _meaning) in keys.items():
        assert reruns == reruns_text(key), key
    extras = readme_cells("| setting | re-runs |")
    assert list(extras) == TABLE_EXTRAS
    for row, (reruns,) in extras.items():
        assert reruns == reruns_text(table_setting(row)), row
    follows = readme_cells("| rule | followed by |")
    assert list(follows) == list(RULE_ORDER)
    for rule, (after,) in follows.items():
        assert after == followers_text(rule), rule


def test_the_dag_copy_matches_snakemakes_rule_graph(tmp_path):
    workdir = copy_workflow(tmp_path / "workflow")
    # The demo's DAG with every optional rule in it: free methods, other kinds and a starting
    # drafter are off by default.
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--rulegraph",
            "--forceall",
            "--config",
            "evaluation={'free_methods': ['ngram']}",
            # Any existing directory stands for a starting drafter: the graph reads no weights.
            "training={'kinds': ['eagle3', 'peagle'], 'from_pretrained': 'config'}",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    names = dict(re.findall(r'^\s*(\d+)\[label = "([^"]+)"', run.stdout, re.MULTILINE))
    edges: dict[str, set[str]] = {name: set() for name in names.values() if name != "all"}
    for source, target in re.findall(r"^\s*(\d+) -> (\d+)", run.stdout, re.MULTILINE):
        if names[target] != "all":
            edges[names[source]].add(names[target])
    # Every rule but the GGUF conversion, which the demo (a built target) cannot have.
    assert edges == {rule: set(consumers) for rule, consumers in CONSUMERS.items() if rule != "gguf_target"}


def test_operational_keys_are_in_no_rules_params():
    config = demo_config()
    for rule in RULE_ORDER:
        tracked = tracked_settings(config, rule)
        assert "server.startup_timeout_s" not in tracked
        assert not any(key.startswith("evaluation.") for key in tracked) or rule.startswith("evaluat")
        assert "evaluation.request_timeout_s" not in tracked and "evaluation.max_retries" not in tracked
    assert "evaluation.concurrency" in tracked_settings(config, "evaluate_baseline")
    assert tracked_settings(config, "plan_snapshot") == {}


def test_server_options_are_split_by_whether_they_change_numerics():
    config = demo_config()
    config["server"]["extra_args"] = [
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization=0.5",
        "--enforce-eager",
        "--kv-cache-dtype",
        "fp8",
    ]
    config["server"]["env"] = {"VLLM_CPU_KVCACHE_SPACE": 1, "VLLM_ATTENTION_BACKEND": "X", "NCCL_DEBUG": "INFO"}
    generate = tracked_settings(config, "generate")
    assert generate["server.extra_args[numerics]"] == [["--dtype", "bfloat16"], ["--kv-cache-dtype", "fp8"]]
    assert generate["server.env[numerics]"] == {"VLLM_ATTENTION_BACKEND": "X"}
    assert "server.extra_args[other]" not in generate
    evaluate = tracked_settings(config, "evaluate_drafter")
    assert evaluate["server.extra_args[other]"] == [["--gpu-memory-utilization=0.5"], ["--enforce-eager"]]
    assert evaluate["server.env[other]"] == {"NCCL_DEBUG": "INFO", "VLLM_CPU_KVCACHE_SPACE": 1}


def test_software_versions_are_tracked_only_where_they_shape(monkeypatch):
    config = demo_config()
    monkeypatch.setattr(settings, "installed_version", lambda name: f"{name}-1")
    assert tracked_settings(config, "extract")["software"] == {"vllm": "vllm-1"}
    assert "software" not in tracked_settings(config, "generate")
    assert set(tracked_settings(config, "train")["software"]) == {"speculators", "torch", "transformers"}


def test_the_trainer_process_count_is_tracked_not_the_slot_itself():
    config = demo_config()
    before = tracked_settings(config, "train")
    assert tracked_settings({**config, "gpu_slot": 8}, "train") == before  # cpu: one process
    cuda = {**config, "device": "cuda"}
    assert tracked_settings({**cuda, "gpu_slot": 8}, "train") != tracked_settings(cuda, "train")


def test_a_stage_sees_only_what_its_rule_declares():
    view = stage_view(demo_config(), "evaluate_baseline")
    assert view["evaluation"]["concurrency"] == [8, 4]
    assert view["server"]["extra_args"]  # a derived setting brings its key
    assert list(view["generation"]) == ["sampling"]  # through evaluation.samplings
    with pytest.raises(KeyError):
        view["generation"]["max_tokens"]
    with pytest.raises(KeyError):
        view["training"]
    assert stage_view({"target": {"model": "m"}}, "generate") == {"target": {"model": "m"}}
    assert stage_view(demo_config(), "run_metadata") == demo_config()


@pytest.mark.parametrize("rule", ["extract", "training_view", "train", "untrained_drafter", "plan"])
def test_every_stage_that_sizes_the_stored_rows_sees_the_disk_budget(rule):
    """The stages that read hidden_states.disk_budget (directly or through the training
    stage's checks) get it, and the served dtype that sizes a row, in their view: a missing
    key was a KeyError only an e2e found."""
    config = demo_config()
    config["hidden_states"]["disk_budget"] = "1 MB"
    config["server"]["extra_args"] = ["--dtype", "float32"]
    view = settings.stage_view(config, rule)
    if rule == "training_view":  # reads the shards' manifests, never the config
        assert "hidden_states" not in view
    else:
        assert RunConfig.from_dict(view).hidden_states.limited_budget == 10**6
        requested = RunConfig.from_dict(view).server.requested_dtype
        assert served_dtype(None, requested) == "float32"  # and the dtype that sizes a value


def test_a_named_prompt_limit_keeps_the_questions_when_the_answers_get_shorter_or_the_context_longer():
    """The questions stage tracks the limit it applies, not its parts: under a named
    questions.max_prompt_tokens, a change that leaves the limit where it was re-runs no question."""
    base = demo_config()
    base["questions"]["max_prompt_tokens"] = 300  # below the room: 512 - 64
    # (A longer context also moves the evaluation's limit: its sets are re-read.)
    for key, value in (("generation.max_tokens", 48), ("server.max_model_len", 1024)):
        changed = yaml.safe_load(yaml.safe_dump(base))
        section, leaf = key.split(".")
        changed[section][leaf] = value
        found = settings.reruns_between(base, changed)
        assert "questions" not in found and "plan_snapshot" in found, (key, sorted(found))
    changed = yaml.safe_load(yaml.safe_dump(base))
    changed["generation"]["max_tokens"] = 400  # now the room (112) is below the named limit
    assert "questions" in settings.reruns_between(base, changed)


@pytest.mark.parametrize(
    ("capture", "key", "value", "reruns", "stays"),
    [
        # Storing fp8 re-makes the shards and retrains; the answers and the dataset stay.
        ("separate", "hidden_states.stored_dtype", "fp8", {"extract", "train"}, {"generate", "dataset"}),
        # In one pass (the demo's) the answers and their states are one job's output.
        ("during_generation", "hidden_states.stored_dtype", "fp8", {"generate", "extract", "train"}, set()),
        # Fully online: training again, and no extraction job in the DAG at all.
        ("separate", "hidden_states.disk_budget", 0, {"train"}, {"extract", "generate", "dataset"}),
        # One more draft length is one more job; the others and the baseline stay.
        (
            "during_generation",
            "evaluation.num_speculative_tokens",
            [3, 1, 2],
            {"evaluate_drafter"},
            {"evaluate_baseline", "train"},
        ),
    ],
)
def test_what_a_change_reruns_on_a_finished_run(capture, key, value, reruns, stays):
    base = demo_config()
    base["hidden_states"]["capture"] = capture
    changed = yaml.safe_load(yaml.safe_dump(base))
    section, leaf = key.split(".")
    changed[section][leaf] = value
    validate(changed, str(SCHEMA))
    found = settings.reruns_between(base, changed)
    assert reruns <= found and not stays & found, sorted(found)


# Keys the demo cannot change alone, so its rerun matrix has no row for them: why each.
NOT_IN_THE_MATRIX = {
    "target.gguf": "the demo builds its target; a GGUF target and build_demo exclude each other",
    "target.gguf_dtype": "read only with target.gguf",
    "training.kind_args": "the demo trains EAGLE-3 alone: kind_args shape train_kind jobs it does not have",
}


def test_every_declared_key_has_a_row_in_the_rerun_matrix_or_a_reason():
    """A new key needs its row in tests/test_rerun_matrix.py: the demo's own plan held to what
    its declaration says."""
    from test_rerun_matrix import MATRIX

    in_matrix = {key for key, *_ in MATRIX}
    missing = [key for key in declarations() if key not in in_matrix and key not in NOT_IN_THE_MATRIX]
    assert missing == [], f"add a row to tests/test_rerun_matrix.py's MATRIX for {missing}"
    assert not in_matrix & set(NOT_IN_THE_MATRIX)
