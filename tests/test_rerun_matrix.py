"""The invalidation matrix on the finished demo: each config key changed alone, `snakemake -n`
plans exactly the rules settings.py names for it (``settings.reruns_between``). Planning only:
no stage runs."""

import copy
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from demo_run import demo_config, dry_run
from snakemake.utils import validate

from draftsmith.settings import reruns_between

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def test_a_generation_change_replans_generation_and_what_follows(demo_run):
    config = demo_config(demo_run)
    config["generation"]["max_tokens"] = 48
    jobs = dry_run(demo_run, config, "max_tokens")
    assert jobs.get("generate") == config["questions"]["shards"]
    assert {"dataset", "extract", "train", "evaluate"} <= jobs.keys()
    # Shorter answers leave room for longer prompts: the questions stage re-measures them.
    assert jobs.get("questions") == 1 and "demo_model" not in jobs


# One change at a time, to every key of the schema, and the hard cases (server options that
# do or do not change numerics, re-sharding): (key, new value[, the other changes it needs]).
SEPARATE = {"hidden_states.capture": "separate"}
MATRIX = [
    ("results_dir", "results_elsewhere"),
    ("device", "cuda"),
    ("gpu_slot", 2),
    ("target.model", "results/demo_model_b"),
    ("target.build_demo", False),
    ("target.demo_architecture", "deepseek_v3"),
    ("target.demo_train_steps", 400),
    ("target.trust_remote_code", True),
    ("layers", [1, 3, 4, 5]),
    ("server.tensor_parallel_size", 2),
    ("server.data_parallel_size", 2),
    ("server.max_model_len", 1024),
    ("server.startup_timeout_s", 900),
    ("server.extra_args", ["--enforce-eager", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"]),
    ("server.extra_args", ["--enforce-eager", "--dtype", "float16"]),  # numerics
    ("server.env", {"VLLM_CPU_KVCACHE_SPACE": 2, "HF_HUB_OFFLINE": 1}),
    ("server.env", {"VLLM_CPU_KVCACHE_SPACE": 1, "HF_HUB_OFFLINE": 1, "VLLM_ATTENTION_BACKEND": "X"}),
    ("questions.source", "config/other_questions.jsonl"),
    ("questions.split", "test"),
    ("questions.subset", "other"),
    ("questions.limit", 500),
    ("questions.heldout", 50),
    ("questions.shards", 3),
    ("questions.seed", 1),
    ("questions.turns", "first"),
    ("generation.concurrency", 4),
    ("generation.max_tokens", 48),
    ("questions.max_prompt_tokens", 400),
    ("generation.sampling", {"temperature": 0.5, "top_p": 1.0, "seed": 0}),
    ("generation.max_error_fraction", 0.1),
    ("generation.request_timeout_s", 100),
    ("generation.max_retries", 1),
    # The demo runs in one pass, which needs its own generation server and stored states.
    ("generation.endpoint", {"base_url": "http://127.0.0.1:9/v1"}, SEPARATE),
    ("dataset.seq_length", 400),
    ("dataset.min_trainable_tokens", 2),
    ("extraction.shards", 3),
    ("extraction.concurrency", 4),
    ("extraction.request_timeout_s", 100),
    ("extraction.max_retries", 1),
    ("hidden_states.disk_budget", "1 MB"),  # part of the rows stored, the rest captured
    ("hidden_states.disk_budget", 0, SEPARATE),  # fully online: no extraction job
    ("hidden_states.stored_dtype", "fp8"),
    ("hidden_states.capture", "separate"),  # a prefill extraction instead of one pass
    ("hidden_states.capture_memory_fraction", 0.6),
    ("training.epochs", 16),
    ("training.lr", 0.001),
    ("training.draft_vocab_size", 150),
    ("training.total_seq_len", 1024),
    ("training.num_layers", 2),
    ("training.seed", 1),
    ("training.stall_timeout_s", 100),
    ("training.extra_args", ["--log-freq", "5"]),
    ("training.validation_fraction", 0.2),
    ("training.kinds", ["eagle3", "peagle"]),  # another kind: its training and measurements
    ("training.from_pretrained", "results/drafter"),  # the finished run's own drafter, to fine-tune
    ("training.fine_tune_lr", 0.0005),  # read only when starting from a drafter: nothing
    ("evaluation.num_speculative_tokens", [3, 1, 2]),  # one more draft length
    ("evaluation.num_speculative_tokens", [1, 3]),  # another default: the untrained job's length
    ("evaluation.max_tokens", 32),
    ("evaluation.concurrency", [8, 4, 2]),
    ("evaluation.sampled", False),
    ("evaluation.compare_untrained", False),
    ("evaluation.free_methods", ["ngram"]),  # one job per draft length
    ("evaluation.limit", 10),
    ("evaluation.sets", {"counting": {"source": "config/demo_sets/counting.jsonl", "category_field": "task"}}),
    ("evaluation.request_timeout_s", 100),
    ("evaluation.max_retries", 1),
]


def changed_config(base: dict, key: str, value, also: dict | None = None) -> dict:
    config = copy.deepcopy(base)
    for path, new in {key: value, **(also or {})}.items():
        *parents, leaf = path.split(".")
        section = config
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = new
    return config


def expected_reruns(base: dict, changed: dict) -> set[str]:
    """What settings.py says the change re-runs (``reruns_between``), on the validated configs."""
    schema = str(ROOT / "workflow/schemas/config.schema.yaml")
    base, changed = copy.deepcopy(base), copy.deepcopy(changed)
    validate(base, schema)
    validate(changed, schema)
    return reruns_between(base, changed)


def test_each_key_changed_alone_plans_exactly_what_the_table_says(demo_run):
    """The invalidation matrix: on the finished demo, `snakemake -n` plans exactly the rules
    settings.py names for each key (no stage runs: planning only)."""
    base = demo_config(demo_run)
    other_source = next(value for key, value, *_ in MATRIX if key == "questions.source")
    shutil.copy(demo_run / base["questions"]["source"], demo_run / other_source)
    cases = {f"{key}={json.dumps(value)}": changed_config(base, key, value, *also) for key, value, *also in MATRIX}
    with ThreadPoolExecutor(2) as pool:  # dry runs only read; two at a time on two cores
        jobs = pool.map(lambda item: dry_run(demo_run, item[1], f"matrix_{item[0]}"), enumerate(cases.values()))
        planned = dict(zip(cases, jobs, strict=True))
    wrong = {}
    for case, config in cases.items():
        expected = expected_reruns(base, config)
        if set(planned[case]) != expected:
            wrong[case] = {"planned": sorted(planned[case]), "table": sorted(expected)}
    assert wrong == {}, json.dumps(wrong, indent=1)
    # The scenarios that wasted whole stages before, spelled out. A new draft length is one
    # job (and the summary), the other lengths and the baseline stay.
    assert planned["evaluation.num_speculative_tokens=[3, 1, 2]"] == {
        "evaluate_drafter": 1,
        "evaluate": 1,
        "diagnose_gap": 1,
        "plan_snapshot": 1,
        "run_metadata": 1,
    }
    # A free method added to a finished run: its jobs (one per draft length) and the summary.
    assert planned['evaluation.free_methods=["ngram"]'] == {
        "evaluate_free_method": 2,
        "evaluate": 1,
        "diagnose_gap": 1,
        "plan_snapshot": 1,
        "run_metadata": 1,
    }
    # A kind added to a finished run: its training, its job per draft length, the summary.
    assert planned['training.kinds=["eagle3", "peagle"]'] == {
        "train_kind": 1,
        "evaluate_kind": 2,
        "evaluate": 1,
        "diagnose_gap": 1,
        "plan_snapshot": 1,
        "run_metadata": 1,
    }
    assert planned['training.from_pretrained="results/drafter"'] == {
        "start_drafter": 1,
        "train": 1,
        "evaluate_start": 2,
        "evaluate_drafter": 2,
        "evaluate": 1,
        "diagnose_gap": 1,
        "training_curves": 1,
        "plan_snapshot": 1,
        "run_metadata": 1,
    }
    assert planned["training.fine_tune_lr=0.0005"] == {}
    assert planned["evaluation.request_timeout_s=100"] == {}
    assert planned["server.startup_timeout_s=900"] == {}
    assert planned["questions.shards=3"]["generate"] == 3
