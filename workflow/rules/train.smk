rule train:
    input:
        dataset=f"{RESULTS}/dataset",
        hidden_states=f"{RESULTS}/hidden_states/all",
        model=target_model_input(),
    output:
        drafter=directory(f"{RESULTS}/drafter"),
        spec_config=f"{RESULTS}/drafter_speculative_config.json",
    log:
        f"{LOGS}/train.log",
    conda:
        CONDA_ENV
    resources:
        gpu=config["gpu_slot"],
    params:
        settings=settings(
            "target",
            "server",
            "layers",
            "training",
            "evaluation",
            "device",
            "gpu_slot",
        ),
        staging=f"{STAGING}/train",
        versions=software_versions(),
    shell:
        "python -m draftsmith.train --settings {params.settings:q}"
        " --dataset {input.dataset:q} --hidden-states {input.hidden_states:q}"
        " --staging {params.staging:q} --output {output.drafter:q}"
        " --spec-config {output.spec_config:q} --granted-gpus {resources.gpu} > {log:q} 2>&1"


# The evaluation's baseline: the same drafter, initialized but never trained.
rule untrained_drafter:
    input:
        dataset=f"{RESULTS}/dataset",
        hidden_states=f"{RESULTS}/hidden_states/all",
        model=target_model_input(),
    output:
        drafter=directory(f"{RESULTS}/untrained_drafter"),
        spec_config=f"{RESULTS}/untrained_drafter_speculative_config.json",
    log:
        f"{LOGS}/untrained_drafter.log",
    conda:
        CONDA_ENV
    resources:
        gpu=config["gpu_slot"],
    params:
        settings=settings(
            "target",
            "server",
            "layers",
            "training",
            "evaluation",
            "device",
            "gpu_slot",
        ),
        staging=f"{STAGING}/untrained_drafter",
        versions=software_versions(),
    shell:
        "python -m draftsmith.train --untrained --settings {params.settings:q}"
        " --dataset {input.dataset:q} --hidden-states {input.hidden_states:q}"
        " --staging {params.staging:q} --output {output.drafter:q}"
        " --spec-config {output.spec_config:q} --granted-gpus {resources.gpu} > {log:q} 2>&1"
