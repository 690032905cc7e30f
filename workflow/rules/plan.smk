# `snakemake plan`: the cost plan, printed now (no GPU, no weights: the target's config.json).
rule plan:
    input:
        target_model_input(),
    log:
        log_path("plan"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        config=RUN_CONFIG,
        results=lambda wildcards: RESULTS,
    shell:
        "python -m draftsmith.plan --settings {params.config:q} --results {params.results:q} 2> {log:q}"


# The plan as it stands after the run (measured tokens, bytes on disk), for the report.
# It reads every result it counts; it tracks no setting (a snapshot of the finished run).
rule plan_snapshot:
    input:
        acceptance=path(LAYOUT.acceptance),
        questions=path(LAYOUT.questions_summary),
        completions=completion_shards(),
        hidden_states=extraction_shards(),
        drafter=path(LAYOUT.drafter),
    output:
        json=path(LAYOUT.plan_json),
        table=report(
            path(LAYOUT.plan_table), caption="../report/plan.rst", category="Plan"
        ),
    log:
        log_path("plan_snapshot"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        config=RUN_CONFIG,
        results=lambda wildcards: RESULTS,
    shell:
        "python -m draftsmith.plan --settings {params.config:q} --results {params.results:q}"
        " --output {output.json:q} > /dev/null 2> {log:q}"
