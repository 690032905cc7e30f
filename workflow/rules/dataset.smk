rule dataset:
    input:
        completions=completion_shards(),
        model=target_model_input(),
    output:
        directory(f"{RESULTS}/dataset"),
    log:
        f"{LOGS}/dataset.log",
    conda:
        CONDA_ENV
    params:
        settings=settings("target", "dataset"),
        staging=f"{STAGING}/dataset",
        versions=software_versions(),
    shell:
        "python -m draftsmith.dataset --settings {params.settings:q}"
        " --staging {params.staging:q} --output {output:q}"
        " {input.completions:q} > {log:q} 2>&1"
