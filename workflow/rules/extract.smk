rule extract:
    input:
        dataset=path(LAYOUT.dataset),
        model=target_model_input(),
    output:
        directory(path(LAYOUT.hidden_state_shard("{shard}"))),
    log:
        log_path("extract/shard_{shard}"),
    benchmark:
        benchmark_path("extract/shard_{shard}")
    conda:
        CONDA_ENV
    resources:
        gpu=RUN.gpu_slot,
    params:
        tracked=tracked("extract"),
        config=RUN_CONFIG,
        staging=staging("hidden_states", "{shard}"),
        num_shards=RUN.extraction.shards,
        captures=captured_states_flag(),
    shell:
        "python -m draftsmith.extract --settings {params.config:q}"
        " --dataset {input.dataset:q} --shard {wildcards.shard} --num-shards {params.num_shards}"
        " --staging {params.staging:q} --output {output:q} {params.captures}"
        " --granted-gpus {resources.gpu} > {log:q} 2>&1"


rule training_view:
    input:
        dataset=path(LAYOUT.dataset),
        shards=extraction_shards(),
    output:
        directory(path(LAYOUT.training_view)),
    log:
        log_path("training_view"),
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "python -m draftsmith.training_view --dataset {input.dataset:q}"
        " --output {output:q} {input.shards:q} > {log:q} 2>&1"
