# Figures and metadata for `snakemake --report report.html`.
rule completion_lengths:
    input:
        completion_shards(),
    output:
        report(
            path(LAYOUT.completion_lengths_plot),
            caption="../report/completion_lengths.rst",
            category="Data",
        ),
    log:
        log_path("report/completion_lengths"),
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "python -m draftsmith.report completion-lengths {output:q} {input:q} 2> {log:q}"


rule training_curves:
    input:
        path(LAYOUT.drafter),
    output:
        report(
            path(LAYOUT.training_curves_plot),
            caption="../report/training_curves.rst",
            category="Training",
        ),
    log:
        log_path("report/training_curves"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        metrics=path(LAYOUT.training_metrics),
    shell:
        "python -m draftsmith.report training-curves {output:q}"
        " {params.metrics:q} 2> {log:q}"


# The config and versions of the run that made the evaluation (re-written with it).
rule run_metadata:
    input:
        path(LAYOUT.acceptance),
    output:
        report(
            path(LAYOUT.run_metadata),
            caption="../report/run_metadata.rst",
            category="Run",
        ),
    log:
        log_path("report/run_metadata"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        config=RUN_CONFIG,
    shell:
        "python -m draftsmith.report metadata {output:q} --settings {params.config:q} 2> {log:q}"
