rule extract:
    input:
        dataset=f"{RESULTS}/dataset",
        model=target_model_input(),
    output:
        directory(f"{RESULTS}/hidden_states/shard_{{shard}}"),
    log:
        f"{LOGS}/extract/shard_{{shard}}.log",
    conda:
        CONDA_ENV
    resources:
        gpu=config["gpu_slot"],
    params:
        settings=settings(
            "target", "server", "layers", "extraction", "device", "gpu_slot"
        ),
        staging=f"{STAGING}/hidden_states/shard_{{shard}}",
        num_shards=config["extraction"]["shards"],
        versions=software_versions(),
    shell:
        "python -m draftsmith.extract --settings {params.settings:q}"
        " --dataset {input.dataset:q} --shard {wildcards.shard} --num-shards {params.num_shards}"
        " --staging {params.staging:q} --output {output:q}"
        " --granted-gpus {resources.gpu} > {log:q} 2>&1"


rule training_view:
    input:
        dataset=f"{RESULTS}/dataset",
        shards=extraction_shards(),
    output:
        directory(f"{RESULTS}/hidden_states/all"),
    log:
        f"{LOGS}/training_view.log",
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "python -m draftsmith.training_view --dataset {input.dataset:q}"
        " --output {output:q} {input.shards:q} > {log:q} 2>&1"
