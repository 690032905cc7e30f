# draftsmith: questions -> target completions -> dataset -> hidden states -> drafter -> evaluation.
# Plan: snakemake -n    Run: snakemake --cores all --resources gpu=8
from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

from draftsmith.config_check import config_problem, cross_field_problems
from draftsmith.preflight import check_local_inputs
from draftsmith.run_config import RunConfig

min_version("9.0")


# The demo config applies only when no --configfile is given: Snakemake would otherwise
# merge the demo's keys into a production config.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# One clear line naming the key at fault; then Snakemake's validate fills in the defaults.
if problem := config_problem(config, "workflow/schemas/config.schema.yaml"):
    raise WorkflowError(problem)
validate(config, "workflow/schemas/config.schema.yaml")
# The validated config, typed (draftsmith/run_config.py): the rules read it as RUN.
RUN = RunConfig.from_dict(config)
if problems := cross_field_problems(RUN):
    raise WorkflowError("\n".join(problems))
# Paths the config names must exist, checked on every start (dry runs too): Snakemake does
# not look at the inputs of a finished job, so a mistyped path would pass as "nothing to do".
if missing := check_local_inputs(RUN):
    raise WorkflowError(f"config: {missing[0]}")


# startup.smk puts this interpreter's bin first on PATH, so jobs run in the same environment.
envvars:
    "PATH",


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/startup.smk"
include: "workflow/rules/demo_model.smk"
include: "workflow/rules/gguf_target.smk"
include: "workflow/rules/questions.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/dataset.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/report.smk"


# The config for this run's jobs, then seconds of checks before any server starts or
# weights load (not on dry runs).
onstart:
    write_run_config()
    run_preflight()


rule all:
    default_target: True
    input:
        final_outputs(),
