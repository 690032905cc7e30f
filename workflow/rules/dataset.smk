rule dataset:
    input:
        completions=completion_shards(),
        model=target_model_input(),
    output:
        directory(f"{RESULTS}/dataset"),
    params:
        settings=settings("target", "dataset"),
        staging=f"{STAGING}/dataset",
        versions=software_versions(),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/dataset.log",
    shell:
        "{PYTHON} -m draftsmith.dataset --settings {params.settings:q}"
        " --staging {params.staging:q} --output {output:q}"
        " {input.completions:q} > {log:q} 2>&1"
