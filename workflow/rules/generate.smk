rule generate:
    input:
        questions=f"{RESULTS}/questions/shard_{{shard}}.jsonl",
        model=target_model_input(),
    output:
        f"{RESULTS}/completions/shard_{{shard}}.jsonl",
    params:
        settings=settings("target", "server", "generation", "device", "gpu_slot"),
        staging=f"{STAGING}/completions/shard_{{shard}}",
        versions=software_versions(),
    resources:
        gpu=config["gpu_slot"],
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/generate/shard_{{shard}}.log",
    shell:
        "{PYTHON} -m draftsmith.generate --settings {params.settings:q}"
        " --questions {input.questions:q} --staging {params.staging:q}"
        " --output {output:q} --granted-gpus {resources.gpu} > {log:q} 2>&1"
