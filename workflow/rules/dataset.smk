rule dataset:
    input:
        completions=completion_shards(),
        model=target_model_input(),
    output:
        directory(path(LAYOUT.dataset)),
    log:
        log_path("dataset"),
    conda:
        CONDA_ENV
    params:
        tracked=tracked("dataset"),
        config=RUN_CONFIG,
        staging=staging("dataset"),
    shell:
        "python -m draftsmith.dataset --settings {params.config:q}"
        " --staging {params.staging:q} --output {output:q}"
        " {input.completions:q} > {log:q} 2>&1"
