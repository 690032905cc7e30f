"""The workflow's rules in the groups the config's declarations name (``run_config.setting``)."""

# The measurements, one job per method (and draft length): each serves the target.
EVALUATIONS = (
    "evaluate_baseline",
    "evaluate_drafter",
    "evaluate_kind",
    "evaluate_untrained",
    "evaluate_start",
    "evaluate_free_method",
)
TRAINERS = ("train", "train_kind")
# `snakemake plan` and the report's copy of it: they read, and track nothing.
PLANNERS = ("plan_snapshot", "plan")
# Rules that take the demo target as an input when the workflow builds it.
TARGET_READERS = (
    "questions",
    "generate",
    "dataset",
    "extract",
    "start_drafter",
    *TRAINERS,
    "untrained_drafter",
    "evaluation_sets",
    *EVALUATIONS,
    "diagnose_gap",
)
