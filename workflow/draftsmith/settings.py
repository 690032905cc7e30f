"""Which settings shape which results: what a change re-runs, and what each job may read.

Each config key declares the rules it concerns on its field (``run_config.setting``), split
by what a change of it means:

- ``shapes``: what every item of the rule's output holds (the model, max_tokens, layers...).
  Tracked as the rule's params, so a change re-runs it; staged work made under other
  values is set aside (its fingerprint is ``item_settings``).
- ``extent``: how much work the output holds, not what an item holds (shards, epochs).
  Tracked too, but finished items stay valid and are reused by the re-run.
- ``reads``: how fast, how patient, how many at once, on which GPUs. Read, never tracked:
  changing them re-runs nothing.

Settings that are not keys (a part of one, a value computed from several) are declared the
same way here (``DERIVED``), as is the software whose upgrade changes what a rule makes
(``SOFTWARE_USED``). ``STAGES`` gathers them per rule; the rules' params
(``workflow/rules/common.smk``), the staged-work fingerprints, the "re-runs" column of
config/README.md (``make generated``) and the invalidation-matrix test all derive from it.
Snakemake tracks params, not what a job reads, so the whole config reaches the jobs as a
file (``Layout.run_config``, written at every start) and each job sees only the keys its
rule declares (``stage_view``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from draftsmith.drafter_files import content_fingerprint
from draftsmith.rule_groups import EVALUATIONS, TARGET_READERS, TRAINERS
from draftsmith.run_config import RunConfig, declarations, swept

# --- server options that do not change the numbers a server computes ----------------------
# Everything else in server.extra_args / server.env is presumed to change them (--dtype,
# --quantization, --kv-cache-dtype, an attention backend...): an unknown option re-runs
# rather than risk mixing numerics. These only move memory, batching, logging or placement.
OPERATIONAL_SERVER_FLAGS = frozenset(
    {
        "--gpu-memory-utilization",
        "--enforce-eager",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--swap-space",
        "--cpu-offload-gb",
        "--kv-cache-memory-bytes",
        "--num-gpu-blocks-override",
        "--disable-log-stats",
        "--disable-log-requests",
        "--enable-log-requests",
        "--uvicorn-log-level",
        "--download-dir",
        "--max-parallel-loading-workers",
        "--disable-custom-all-reduce",
        "--distributed-executor-backend",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
    }
)
OPERATIONAL_SERVER_ENV = frozenset(
    {
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "OMP_NUM_THREADS",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HOME",
        "VLLM_LOGGING_LEVEL",
        "VLLM_CACHE_ROOT",
        "VLLM_RPC_TIMEOUT",
        "VLLM_ENGINE_READY_TIMEOUT_S",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "CUDA_VISIBLE_DEVICES",
        "TORCHINDUCTOR_CACHE_DIR",
    }
)
OPERATIONAL_ENV_PREFIXES = ("NCCL_",)

# Distributions by the name a table row uses; the first one installed is the version.
SOFTWARE = {
    "vllm": ("vllm", "vllm-cpu"),
    "speculators": ("speculators",),
    "torch": ("torch",),
    "transformers": ("transformers",),
}


def server_flag_groups(args: Iterable[str]) -> list[list[str]]:
    """``["--dtype", "bf16", "--enforce-eager"]`` -> ``[["--dtype", "bf16"], ["--enforce-eager"]]``."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return groups


def _operational_flag(group: list[str]) -> bool:
    return group[0].split("=", 1)[0] in OPERATIONAL_SERVER_FLAGS


def _operational_env(name: str) -> bool:
    return name in OPERATIONAL_SERVER_ENV or name.startswith(OPERATIONAL_ENV_PREFIXES)


KEYS = declarations()

# The starting drafter by content (training.from_pretrained).
STARTING_DRAFTER = "training.from_pretrained_content"


def typed(config: Mapping[str, Any]) -> RunConfig:
    return RunConfig.from_dict(config)


@dataclass(frozen=True)
class Derived:
    """A setting that is not a config key itself: a part of one, or a value computed from some,
    with the rules it shapes, extends or is read by (as ``run_config.setting`` declares a key's).
    One named like a key replaces that key's value and keeps the key's declared rules."""

    sources: tuple[str, ...]  # the config keys it comes from
    value: Callable[[Mapping[str, Any]], Any]
    shapes: tuple[str, ...] = ()
    extent: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()


SERVER_NUMERICS_READERS = ("generate", "extract", *EVALUATIONS)
SERVER_OTHER_READERS = dict(shapes=EVALUATIONS, reads=("generate", "extract", *TRAINERS))

DERIVED = {
    "server.extra_args[numerics]": Derived(
        ("server.extra_args",),
        lambda c: [g for g in server_flag_groups(typed(c).server.extra_args) if not _operational_flag(g)],
        shapes=(*SERVER_NUMERICS_READERS, "diagnose_gap"),
        reads=("untrained_drafter",),  # --dtype: the bytes of a stored row
    ),
    "server.extra_args[other]": Derived(
        ("server.extra_args",),
        lambda c: [g for g in server_flag_groups(typed(c).server.extra_args) if _operational_flag(g)],
        **SERVER_OTHER_READERS,
    ),
    "server.env[numerics]": Derived(
        ("server.env",),
        lambda c: {k: v for k, v in sorted(typed(c).server.env.items()) if not _operational_env(k)},
        shapes=SERVER_NUMERICS_READERS,
    ),
    "server.env[other]": Derived(
        ("server.env",),
        lambda c: {k: v for k, v in sorted(typed(c).server.env.items()) if _operational_env(k)},
        **SERVER_OTHER_READERS,
    ),
    # One trainer process per GPU of the slot on cuda sets the global batch.
    "trainer_processes": Derived(("device", "gpu_slot"), lambda c: typed(c).trainer_processes, shapes=TRAINERS),
    # The prompt limits, not their parts: a change that leaves a limit where it was re-runs nothing.
    # A conversation's later turns are asked while their prompt is within the limit: a larger
    # one continues the conversations it ended, whose finished turns stay valid.
    "questions.prompt_token_limit": Derived(
        ("server.max_model_len", "generation.max_tokens", "questions.max_prompt_tokens"),
        lambda c: typed(c).question_prompt_limit,
        shapes=("questions",),
        extent=("generate",),
    ),
    "evaluation.prompt_token_limit": Derived(
        ("server.max_model_len", "evaluation.max_tokens"),
        lambda c: typed(c).evaluation_prompt_limit,
        shapes=("evaluation_sets",),
    ),
    "evaluation.samplings": Derived(
        ("evaluation.sampled", "generation.sampling"), lambda c: typed(c).evaluation_samplings, shapes=EVALUATIONS
    ),
    # A mode off by default is None while off (see below).
    # A smaller budget keeps the staged rows it still covers; a larger one adds rows.
    "hidden_states.limited_budget": Derived(
        ("hidden_states.disk_budget",),
        lambda c: typed(c).hidden_states.limited_budget,
        shapes=TRAINERS,
        extent=("extract",),
    ),
    "hidden_states.fp8_storage": Derived(
        ("hidden_states.stored_dtype",),
        lambda c: True if typed(c).hidden_states.fp8 else None,
        shapes=("extract", *TRAINERS),  # the trainer reads dequantized fp8 rows
    ),
    # One pass (hidden_states.capture: during_generation): the generation server saves the
    # states, so generation's answers come with what shapes the states (layers, storage, the
    # vLLM release), and dataset rows end before the final answer token. None while capture
    # is separate, so separate runs keep their params.
    "hidden_states.capture_during_generation": Derived(
        ("hidden_states.capture", "layers", "hidden_states.stored_dtype"),
        lambda c: (
            {"layers": lookup(c, "layers"), "fp8": typed(c).hidden_states.fp8, "vllm": installed_version("vllm")}
            if typed(c).hidden_states.during_generation
            else None
        ),
        shapes=("generate", "dataset", "extract"),
    ),
    # How many answers keep their captured states: each generation shard's share of a disk
    # budget (an extent of generation: finished answers stay when it changes).
    "hidden_states.capture_budget": Derived(
        ("hidden_states.capture", "hidden_states.disk_budget", "questions.shards"),
        lambda c: typed(c).capture_share,
        extent=("generate",),
    ),
    # What computes the rows training captures on demand: the extraction server's numerics
    # and release (with no extraction stage, training is what must re-run on a change).
    "hidden_states.capture_numerics": Derived(
        ("hidden_states.disk_budget", "server.extra_args", "server.env"),
        lambda c: (
            None
            if typed(c).hidden_states.limited_budget is None
            else {
                "server": [lookup(c, key) for key in ("server.extra_args[numerics]", "server.env[numerics]")],
                "vllm": installed_version("vllm"),
            }
        ),
        shapes=TRAINERS,
    ),
    # The starting drafter by content (start_drafter.py): a copy elsewhere or a new mtime re-runs
    # nothing, a changed byte re-trains. None without one, so runs from scratch keep their params.
    STARTING_DRAFTER: Derived(
        ("training.from_pretrained",),
        lambda c: content_fingerprint(path) if (path := typed(c).training.from_pretrained) else None,
        shapes=("start_drafter", "train", "evaluate", "diagnose_gap"),
    ),
    # Read only when training starts from a drafter: None (untracked) otherwise.
    "training.fine_tune_lr": Derived(
        ("training.fine_tune_lr",),
        lambda c: typed(c).training.fine_tune_lr if typed(c).training.from_pretrained else None,  # None: lr
    ),
}


def off(key: str, value: Any) -> bool:
    """A derived setting that is None is a mode left off (a disk budget, fp8 storage): it is
    left out of params, so the runs made before the mode existed keep theirs and are not
    re-run by an upgrade. A new mode off by default is a derived setting that is None; a new
    key is declared ``added_later`` and is left out at its default."""
    if key in DERIVED:
        return value is None
    declared = KEYS.get(key)
    return declared is not None and declared.added_later and value == declared.default


# Settings whose every value is a job of its own (the value is in the output's name): a new
# value adds its job and leaves the others; the rules tracking the whole list re-run.
SWEPT = {
    "evaluation.num_speculative_tokens": (
        "evaluate_drafter",
        "evaluate_free_method",
        "evaluate_kind",
        "evaluate_start",
    ),
    "evaluation.free_methods": ("evaluate_free_method",),
    "training.kinds": ("train_kind", "evaluate_kind"),
}

# The keys that say where results go: a new value starts over in the new place.
WHERE = ("results_dir",)
EVERYTHING = ("*",)  # a stage that reads the whole config (the run metadata)


@dataclass(frozen=True)
class Stage:
    """The settings one rule reads, by what a change of them means (module docstring)."""

    shaping: tuple[str, ...] = ()
    extent: tuple[str, ...] = ()
    operational: tuple[str, ...] = ()
    software: tuple[str, ...] = ()

    @property
    def tracked(self) -> tuple[str, ...]:
        return self.shaping + self.extent


# The software whose upgrade changes what a rule makes. Generation is not here: its answers are
# samples of the target, and another engine release does not make a finished answer wrong.
SOFTWARE_USED: dict[str, tuple[str, ...]] = {
    "gguf_target": ("transformers",),
    "dataset": ("speculators", "transformers"),
    "extract": ("vllm",),
    "start_drafter": ("speculators", "transformers"),
    **dict.fromkeys((*TRAINERS, "untrained_drafter"), ("speculators", "torch", "transformers")),
    **dict.fromkeys(EVALUATIONS, ("vllm",)),
    "diagnose_gap": ("speculators", "transformers"),
}
# Every rule with what its jobs read; `plan` is `snakemake plan`'s, printed and never a result.
RULES = (
    "demo_model",
    "gguf_target",
    "questions",
    "generate",
    "dataset",
    "extract",
    "training_view",
    "start_drafter",
    *TRAINERS,
    "untrained_drafter",
    "evaluation_sets",
    *EVALUATIONS,
    "evaluate",
    "diagnose_gap",
    "plan_snapshot",
    "run_metadata",
    "completion_lengths",
    "training_curves",
    "plan",
)


def _stages() -> dict[str, Stage]:
    """Each rule's settings, gathered from the declarations of the keys (run_config.py) and of
    the derived settings. A declaration that names no rule of the workflow fails here."""
    roles: dict[str, dict[str, list[str]]] = {rule: {"shaping": [], "extent": [], "operational": []} for rule in RULES}
    declared = [(key, d.shapes, d.extent, d.reads) for key, d in KEYS.items()]
    declared += [(key, d.shapes, d.extent, d.reads) for key, d in DERIVED.items()]
    for key, shapes, extent, reads in declared:
        for role, rules in (("shaping", shapes), ("extent", extent), ("operational", reads)):
            for rule in rules:
                if rule not in roles:
                    raise ValueError(f"{key} names the rule {rule!r}, which the workflow does not have")
                roles[rule][role].append(key)
    stages = {
        rule: Stage(
            shaping=tuple(found["shaping"]),
            extent=tuple(found["extent"]),
            operational=tuple(found["operational"]),
            software=SOFTWARE_USED.get(rule, ()),
        )
        for rule, found in roles.items()
    }
    stages["run_metadata"] = Stage(operational=EVERYTHING)
    return stages


STAGES: dict[str, Stage] = _stages()

# Which rules read each rule's output (the DAG; tests/test_settings.py checks it against
# Snakemake's own). A rule that re-runs re-runs everything that reads it.
CONSUMERS: dict[str, tuple[str, ...]] = {
    "demo_model": TARGET_READERS,
    "gguf_target": TARGET_READERS,
    "questions": ("generate", "evaluation_sets", "diagnose_gap", "plan_snapshot"),
    "generate": ("dataset", "completion_lengths", "diagnose_gap", "plan_snapshot"),
    "dataset": ("extract", "training_view", "train", "train_kind", "untrained_drafter", "diagnose_gap"),
    "extract": ("training_view", "diagnose_gap", "plan_snapshot"),
    "training_view": ("train", "train_kind", "untrained_drafter"),
    "start_drafter": ("train", "evaluate_start"),
    "train": ("evaluate_drafter", "training_curves", "diagnose_gap", "plan_snapshot"),
    "train_kind": ("evaluate_kind",),
    "untrained_drafter": ("evaluate_untrained",),
    "evaluation_sets": EVALUATIONS,
    "evaluate_baseline": ("evaluate",),
    "evaluate_drafter": ("evaluate",),
    "evaluate_kind": ("evaluate",),
    "evaluate_untrained": ("evaluate",),
    "evaluate_start": ("evaluate",),
    "evaluate_free_method": ("evaluate",),
    "evaluate": ("diagnose_gap", "plan_snapshot", "run_metadata"),
    "diagnose_gap": (),
    "completion_lengths": (),
    "training_curves": (),
    "plan_snapshot": (),
    "run_metadata": (),
}
RULE_ORDER = tuple(CONSUMERS)


# --- values --------------------------------------------------------------------------------


def lookup(config: Mapping[str, Any], key: str) -> Any:
    """The value of a dotted key, or of a derived setting (``DERIVED``)."""
    if key in DERIVED:
        return DERIVED[key].value(config)
    value: Any = config
    for part in key.split("."):
        value = value[part]
    return value


def _lookup_or_none(config: Mapping[str, Any], key: str) -> Any:
    """A key a hand-written partial config leaves out (an optional one) counts as None."""
    try:
        return lookup(config, key)
    except KeyError:
        return None


def config_keys(key: str) -> tuple[str, ...]:
    """The real config keys behind a declared setting."""
    return DERIVED[key].sources if key in DERIVED else (key,)


def installed_version(name: str) -> str:
    for distribution in SOFTWARE[name]:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def tracked_settings(config: dict[str, Any], rule: str) -> dict[str, Any]:
    """What the rule's params carry: a change of any of these re-runs it."""
    stage = STAGES[rule]
    values = {key: lookup(config, key) for key in stage.tracked}
    values = {key: value for key, value in values.items() if not off(key, value)}
    if stage.software:
        values["software"] = {name: installed_version(name) for name in stage.software}
    return values


def kind_view(tracked: dict[str, Any], kind: str) -> dict[str, Any]:
    """One kind's job's params: its own kind_args, so a change of another kind's leaves it."""
    if "training.kind_args" not in tracked:
        return tracked
    return tracked | {"training.kind_args": tracked["training.kind_args"].get(kind, [])}


def item_settings(config: Mapping[str, Any], rule: str) -> dict[str, Any]:
    """What each staged item of the rule depends on: staged work made under other values
    is set aside. Extent settings are left out, so more shards or epochs reuse it."""
    stage = STAGES[rule]
    values = {key: _lookup_or_none(config, key) for key in stage.shaping}
    values = {key: value for key, value in values.items() if not off(key, value)}
    values["software"] = {name: installed_version(name) for name in stage.software}
    return values


def stage_view(config: dict[str, Any], rule: str) -> dict[str, Any]:
    """The config restricted to what the rule declares: reading any other key is a KeyError,
    so a stage cannot depend on a setting its rule does not account for. Keys absent
    from ``config`` (a hand-written partial config) are left out."""
    stage = STAGES[rule]
    declared = stage.shaping + stage.extent + stage.operational
    if EVERYTHING[0] in declared:
        return copy.deepcopy(config)
    view: dict[str, Any] = {}
    for key in {real for setting in declared for real in config_keys(setting)}:
        source, target, *path = config, view, *key.split(".")
        for part in path[:-1]:
            if part not in source:
                break
            source, target = source[part], target.setdefault(part, {})
        else:
            if path[-1] in source:
                target[path[-1]] = copy.deepcopy(source[path[-1]])
    return view


def dumps(values: dict[str, Any]) -> str:
    """Params as Snakemake stores them: one stable string."""
    return json.dumps(values, sort_keys=True)


# --- what a change re-runs -----------------------------------------------------------------


def downstream(rules: Iterable[str]) -> set[str]:
    """The rules and everything that reads their outputs, transitively."""
    found, todo = set(), list(rules)
    while todo:
        rule = todo.pop()
        if rule not in found:
            found.add(rule)
            todo.extend(CONSUMERS.get(rule, ()))
    return found


# Derived settings that exist only in one mode: config/README.md names the rules reached only
# through them apart ("in one pass also ..."), so the column is right for the default mode.
ONE_PASS_ONLY = ("hidden_states.capture_during_generation", "hidden_states.capture_budget")


def rules_tracking(setting: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Rules that track a declared setting, a config key (through any setting derived from
    it, except those in ``skip``) or a software name."""
    rules = []
    for rule, stage in STAGES.items():
        sources = {
            real for tracked in stage.tracked if tracked not in skip for real in (tracked, *config_keys(tracked))
        }
        if setting in sources or setting in stage.software:
            rules.append(rule)
    return rules


def reruns(setting: str) -> list[str]:
    """The rules a change of ``setting`` re-runs, in pipeline order."""
    if setting in WHERE:  # a built target (demo, GGUF) is at target.model, not under results_dir
        return [rule for rule in RULE_ORDER if rule not in ("demo_model", "gguf_target")]
    found = downstream(rules_tracking(setting))
    return [rule for rule in RULE_ORDER if rule in found]


def absent_rules(config: dict[str, Any]) -> set[str]:
    """Rules this config's DAG leaves out (common.smk): no demo build, no untrained
    drafter, and no extraction when nothing is stored."""
    absent, run = set(), typed(config)
    if not run.target.build_demo:
        absent.add("demo_model")
    if not run.target.gguf:
        absent.add("gguf_target")
    if not run.evaluation.compare_untrained:
        absent.add("untrained_drafter")
    if run.hidden_states.limited_budget == 0:
        absent.add("extract")
    if not run.evaluation.free_methods:
        absent.add("evaluate_free_method")
    if not run.training.other_kinds:
        absent.update(("train_kind", "evaluate_kind"))
    if run.training.from_pretrained is None:
        absent.update(("start_drafter", "evaluate_start"))
    return absent


def reruns_between(base: dict[str, Any], changed: dict[str, Any]) -> set[str]:
    """The rules a finished run of ``base`` re-runs when its config becomes ``changed`` (both
    validated): those whose tracked settings differ and what follows them, among the rules
    ``changed`` has. The matrix test holds Snakemake's own plan to this."""
    if any(lookup(base, key) != lookup(changed, key) for key in WHERE):
        found = set(reruns(WHERE[0]))
    else:
        found = downstream(
            rule for rule in RULE_ORDER if tracked_settings(base, rule) != tracked_settings(changed, rule)
        )
    for key, rules in SWEPT.items():
        if set(swept(lookup(changed, key))) - set(swept(lookup(base, key))):
            found.update(rules)  # a new value is a job of its own; the others stay
    found -= absent_rules(changed)
    after, before = typed(changed).evaluation, typed(base).evaluation
    if after.compare_untrained and after.draft_lengths[0] != before.draft_lengths[0]:
        found.add("evaluate_untrained")  # measured at the default draft length only
    return found


def reruns_text(setting: str) -> str:
    """config/README.md's "re-runs" cell: the rules that track the setting, and what follows them
    (``followers_text``)."""
    if setting in WHERE:
        return "everything, in the new directory (a built demo target stays at `target.model`)"
    rules = [rule for rule in RULE_ORDER if rule in rules_tracking(setting, skip=ONE_PASS_ONLY)]
    one_pass = [rule for rule in RULE_ORDER if rule in rules_tracking(setting) and rule not in rules]
    if one_pass and not rules:  # the mode's own switch
        rules, one_pass = one_pass, []
    also = "; in one pass also " + ", ".join(f"`{rule}`" for rule in one_pass) if one_pass else ""
    if setting in SWEPT:
        names = [f"`{rule}`" for rule in SWEPT[setting]]
        jobs = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)
        return f"{jobs} for each new value, " + ", ".join(f"`{rule}`" for rule in rules) + " and what follows"
    return (", ".join(f"`{rule}`" for rule in rules) + " and what follows" if rules else "nothing") + also


def followers_text(rule: str) -> str:
    """What follows a rule: config/README.md's table of what re-runs after each one."""
    after = [other for other in RULE_ORDER if other in downstream([rule]) - {rule}]
    return ", ".join(f"`{other}`" for other in after) or "nothing"


def schema_keys(schema_path: Path) -> list[str]:
    """Every settable key of the schema, dotted (objects without properties are one key)."""
    schema = yaml.safe_load(schema_path.read_text())

    def walk(properties: dict[str, Any], prefix: str) -> list[str]:
        keys = []
        for name, spec in properties.items():
            if spec.get("type") == "object" and "properties" in spec:
                keys += walk(spec["properties"], f"{prefix}{name}.")
            else:
                keys.append(prefix + name)
        return keys

    return walk(schema["properties"], "")


# The rows of config/README.md's tables that are not plain keys.
TABLE_EXTRAS = [key for key in DERIVED if "[" in key] + [f"software: {name}" for name in SOFTWARE]


def table_setting(row: str) -> str:
    return row.removeprefix("software: ")
