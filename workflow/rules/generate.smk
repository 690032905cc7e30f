rule generate:
    input:
        questions=path(LAYOUT.question_shard("{shard}")),
        model=target_model_input(),
    output:
        path(LAYOUT.completion_shard("{shard}")),
    log:
        log_path("generate/shard_{shard}"),
    benchmark:
        benchmark_path("generate/shard_{shard}")
    conda:
        CONDA_ENV
    resources:
        gpu=RUN.gpu_slot,
    params:
        tracked=tracked("generate"),
        config=RUN_CONFIG,
        staging=staging("completions", "{shard}"),
    shell:
        "python -m draftsmith.generate --settings {params.config:q}"
        " --questions {input.questions:q} --staging {params.staging:q}"
        " --output {output:q} --granted-gpus {resources.gpu} > {log:q} 2>&1"
