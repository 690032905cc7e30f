# Figures and metadata for `snakemake --report report.html`.
rule completion_lengths:
    input:
        completion_shards(),
    output:
        report(
            f"{RESULTS}/report/completion_lengths.png",
            caption="../report/completion_lengths.rst",
            category="Data",
        ),
    log:
        f"{LOGS}/report/completion_lengths.log",
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "python -m draftsmith.report completion-lengths {output:q} {input:q} 2> {log:q}"


rule training_curves:
    input:
        f"{RESULTS}/drafter",
    output:
        report(
            f"{RESULTS}/report/training_curves.png",
            caption="../report/training_curves.rst",
            category="Training",
        ),
    log:
        f"{LOGS}/report/training_curves.log",
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "python -m draftsmith.report training-curves {output:q}"
        " {input:q}/training_metrics.json 2> {log:q}"


rule run_metadata:
    output:
        report(
            f"{RESULTS}/report/run_metadata.txt",
            caption="../report/run_metadata.rst",
            category="Run",
        ),
    log:
        f"{LOGS}/report/run_metadata.log",
    localrule: True
    conda:
        CONDA_ENV
    params:
        settings=settings(*config),
        versions=software_versions(),
    shell:
        "python -m draftsmith.report metadata {output:q} --settings {params.settings:q} 2> {log:q}"
