# The published drafter training.from_pretrained names, copied or converted to speculators'
# format, with its vocabulary map. Tracked by content (settings.py), not by path.
rule start_drafter:
    input:
        model=target_model_input(),
    output:
        directory(path(LAYOUT.start_drafter)),
    log:
        log_path("start_drafter"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        tracked=tracked("start_drafter"),
        config=RUN_CONFIG,
        staging=staging("start_drafter"),
    shell:
        "python -m draftsmith.start_drafter --settings {params.config:q}"
        " --staging {params.staging:q} --output {output:q} > {log:q} 2>&1"


rule train:
    input:
        dataset=path(LAYOUT.dataset),
        hidden_states=path(LAYOUT.training_view),
        model=target_model_input(),
        start=start_drafter_input(),
    output:
        directory(path(LAYOUT.drafter)),
    log:
        log_path("train"),
    benchmark:
        benchmark_path("train")
    conda:
        CONDA_ENV
    resources:
        gpu=RUN.gpu_slot,
    params:
        tracked=tracked("train"),
        config=RUN_CONFIG,
        staging=staging("train"),
        mode=lambda wildcards, input: (
            f"--start-drafter {shlex.quote(input.start[0])}" if input.start else ""
        ),
    shell:
        "python -m draftsmith.train {params.mode} --settings {params.config:q}"
        " --dataset {input.dataset:q} --hidden-states {input.hidden_states:q}"
        " --staging {params.staging:q} --output {output:q}"
        " --granted-gpus {resources.gpu} > {log:q} 2>&1"


# The evaluation's baseline: the same drafter, initialized but never trained.
use rule train as untrained_drafter with:
    input:
        dataset=path(LAYOUT.dataset),
        hidden_states=path(LAYOUT.training_view),
        model=target_model_input(),
    output:
        directory(path(LAYOUT.untrained_drafter)),
    log:
        log_path("untrained_drafter"),
    benchmark:
        benchmark_path("untrained_drafter")
    params:
        tracked=tracked("untrained_drafter"),
        config=RUN_CONFIG,
        staging=staging("untrained_drafter"),
        mode="--untrained",


# Each other kind of drafter (training.kinds) from the same rows and hidden states.
use rule train as train_kind with:
    input:
        dataset=path(LAYOUT.dataset),
        hidden_states=path(LAYOUT.training_view),
        model=target_model_input(),
    output:
        directory(path(LAYOUT.kind_drafter("{kind}"))),
    log:
        log_path("train_{kind}"),
    benchmark:
        benchmark_path("train_{kind}")
    wildcard_constraints:
        kind=KIND_NAMES,
    params:
        tracked=tracked_for_kind("train_kind"),
        config=RUN_CONFIG,
        staging=lambda wildcards: staging(f"train_{wildcards.kind}"),
        mode=lambda wildcards: f"--kind {wildcards.kind}",
