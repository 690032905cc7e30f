rule generate:
    input:
        questions=f"{RESULTS}/questions/shard_{{shard}}.jsonl",
        model=target_model_input(),
    output:
        f"{RESULTS}/completions/shard_{{shard}}.jsonl",
    log:
        f"{LOGS}/generate/shard_{{shard}}.log",
    conda:
        CONDA_ENV
    resources:
        gpu=config["gpu_slot"],
    params:
        settings=settings("target", "server", "generation", "device", "gpu_slot"),
        staging=f"{STAGING}/completions/shard_{{shard}}",
        versions=software_versions(),
    shell:
        "python -m draftsmith.generate --settings {params.settings:q}"
        " --questions {input.questions:q} --staging {params.staging:q}"
        " --output {output:q} --granted-gpus {resources.gpu} > {log:q} 2>&1"
