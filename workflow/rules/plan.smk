# `snakemake plan`: the cost plan, printed now (no GPU, no weights: the target's config.json).
rule plan:
    input:
        target_model_input(),
    log:
        f"{LOGS}/plan.log",
    localrule: True
    conda:
        CONDA_ENV
    params:
        settings=settings(*config),
    shell:
        "python -m draftsmith.plan --settings {params.settings:q} 2> {log:q}"


# The plan as it stands after the run (measured tokens, bytes on disk), for the report.
rule plan_snapshot:
    input:
        f"{RESULTS}/eval/acceptance.json",
    output:
        json=f"{RESULTS}/plan.json",
        table=report(
            f"{RESULTS}/plan.txt", caption="../report/plan.rst", category="Plan"
        ),
    log:
        f"{LOGS}/plan_snapshot.log",
    localrule: True
    conda:
        CONDA_ENV
    params:
        settings=settings(*config),
    shell:
        "python -m draftsmith.plan --settings {params.settings:q}"
        " --output {output.json:q} > /dev/null 2> {log:q}"
