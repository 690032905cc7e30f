# Paths, tracked settings and input functions shared by the rule files.
import shlex

from snakemake.exceptions import WorkflowError

from draftsmith.layout import Layout
from draftsmith.question_sources import is_local_source
from draftsmith.settings import dumps, kind_view, tracked_settings

LAYOUT = Layout(RUN.results_dir)
RESULTS = str(LAYOUT.results)
# Every job reads the whole config from this file (written at each start), and sees only
# the keys that name its rule in their declarations (draftsmith/run_config.py, gathered by
# draftsmith/settings.py); params carry what is tracked.
RUN_CONFIG = str(LAYOUT.run_config)
# For `--sdm conda`; relative to the rule files.
CONDA_ENV = f"../../envs/{'cpu' if RUN.device == 'cpu' else 'gpu'}.yaml"

QUESTION_SHARDS = list(range(RUN.questions.shards))
# A disk budget of 0 stores no hidden states: training captures every row, nothing extracts.
STORES_HIDDEN_STATES = RUN.hidden_states.limited_budget != 0
EXTRACTION_SHARDS = list(range(RUN.extraction.shards)) if STORES_HIDDEN_STATES else []
# The evaluate_free_method jobs' wildcard: only the configured methods (never "drafter").
FREE_METHOD_NAMES = "|".join(RUN.evaluation.free_methods) or "(?!)"
# The train_kind and evaluate_kind jobs' wildcard: the kinds trained beside EAGLE-3.
KIND_NAMES = "|".join(RUN.training.other_kinds) or "(?!)"


def path(location):
    return str(location)


def log_path(name):
    return str(LAYOUT.log(name))


def benchmark_path(name):
    return str(LAYOUT.benchmark(name))


def staging(stage, shard=None):
    return str(LAYOUT.staging_for(stage, shard))


def tracked(rule):
    """The rule's params: the settings that shape its output (draftsmith/settings.py)."""
    return dumps(tracked_settings(config, rule))


def tracked_for_kind(rule):
    """A kind's job's params (train_kind): its own kind_args only."""
    settings = tracked_settings(config, rule)
    return lambda wildcards: dumps(kind_view(settings, wildcards.kind))


def target_model_input():
    """A demo or GGUF target is built by a rule; a production target is a path we only read."""
    return [RUN.target.model] if RUN.target.build_demo or RUN.target.gguf else []


def questions_source_input():
    """A local question file is an input (editing it re-runs); a hub id is not a file."""
    source = RUN.questions.source
    return [source] if is_local_source(source) else []


def completion_shards():
    return [path(LAYOUT.completion_shard(shard)) for shard in QUESTION_SHARDS]


def captured_states_flag():
    """One pass: the extraction adopts the states the generation shards staged."""
    if not RUN.hidden_states.during_generation:
        return ""
    dirs = shlex.join(staging("completions", shard) for shard in QUESTION_SHARDS)
    return f"--captures {dirs}"


def extraction_shards():
    return [path(LAYOUT.hidden_state_shard(shard)) for shard in EXTRACTION_SHARDS]


def evaluation_set_inputs():
    """The sets' local files are inputs (editing one re-runs the evaluation); hub ids are not."""
    sources = [spec.source for spec in RUN.evaluation.sets.values()]
    return [source for source in sources if is_local_source(source)]


def every_core():
    """All the cores Snakemake may use here. A cluster executor (SLURM) has none: each job
    asks for its own cpus_per_task, and asking Snakemake would fail the parse."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def measurement_threads():
    """A throughput measurement runs alone: on a CPU host it takes every core, so no other
    job shares them (on GPUs the slot already keeps measurements apart)."""
    return every_core() if RUN.device == "cpu" else 1


def drafter_measurements():
    return [path(LAYOUT.drafter_measurement(k)) for k in RUN.evaluation.draft_lengths]


def free_method_measurements():
    return [
        path(LAYOUT.free_method_measurement(method, k))
        for method in RUN.evaluation.free_methods
        for k in RUN.evaluation.draft_lengths
    ]


def kind_measurements():
    return [
        path(LAYOUT.kind_measurement(kind, k))
        for kind in RUN.training.other_kinds
        for k in RUN.evaluation.draft_lengths
    ]


def start_drafter_input():
    """The drafter training starts from (training.from_pretrained), if any."""
    return [path(LAYOUT.start_drafter)] if RUN.training.from_pretrained else []


def start_measurements():
    if not RUN.training.from_pretrained:
        return []
    return [path(LAYOUT.start_measurement(k)) for k in RUN.evaluation.draft_lengths]


def untrained_measurement_input():
    """The untrained drafter, measured at the default (first) draft length."""
    if RUN.evaluation.compare_untrained:
        return [path(LAYOUT.untrained_measurement(RUN.evaluation.draft_lengths[0]))]
    return []


def final_outputs():
    """Every published artifact, so a rerun rebuilds whichever is missing (a forced training
    stopped half way leaves no drafter, and the evaluation alone would not ask for it).
    """
    return [
        path(LAYOUT.drafter),
        *[path(LAYOUT.kind_drafter(kind)) for kind in RUN.training.other_kinds],
        path(LAYOUT.speculative_config),
        path(LAYOUT.acceptance),
        path(LAYOUT.acceptance_gap),
        path(LAYOUT.acceptance_plot),
        path(LAYOUT.speedup_plot),
        path(LAYOUT.evaluation_tables),
        path(LAYOUT.plan_json),
        path(LAYOUT.completion_lengths_plot),
        path(LAYOUT.training_curves_plot),
        path(LAYOUT.run_metadata),
    ]
