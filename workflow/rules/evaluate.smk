# The prompts: the held-out split and every set of evaluation.sets, read once; those that
# leave no room for evaluation.max_tokens are dropped and counted (eval/sets.json).
rule evaluation_sets:
    input:
        heldout=path(LAYOUT.heldout),
        sources=evaluation_set_inputs(),
        model=target_model_input(),
    output:
        prompts=path(LAYOUT.evaluation_prompts),
        summary=path(LAYOUT.evaluation_sets_summary),
    log:
        log_path("evaluate/sets"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        tracked=tracked("evaluation_sets"),
        config=RUN_CONFIG,
    shell:
        "python -m draftsmith.evaluation_sets --settings {params.config:q}"
        " --heldout {input.heldout:q} --output {output.prompts:q}"
        " --summary {output.summary:q} > {log:q} 2>&1"


# The target alone, once: every set, concurrency and sampling on one server.
rule evaluate_baseline:
    input:
        prompts=path(LAYOUT.evaluation_prompts),
        model=target_model_input(),
    output:
        path(LAYOUT.baseline_measurement),
    log:
        log_path("evaluate/baseline"),
    benchmark:
        benchmark_path("evaluate/baseline")
    conda:
        CONDA_ENV
    threads: measurement_threads()
    resources:
        gpu=RUN.gpu_slot,
    params:
        tracked=tracked("evaluate_baseline"),
        config=RUN_CONFIG,
    shell:
        "python -m draftsmith.evaluate --settings {params.config:q} --stage evaluate_baseline"
        " --prompts {input.prompts:q} --output {output:q}"
        " --granted-gpus {resources.gpu} > {log:q} 2>&1"


# One job per draft length: adding a length to the sweep runs only its job (and the summary).
rule evaluate_drafter:
    input:
        prompts=path(LAYOUT.evaluation_prompts),
        drafter=path(LAYOUT.drafter),
        model=target_model_input(),
    output:
        path(LAYOUT.drafter_measurement("{k}")),
    log:
        log_path("evaluate/drafter_k{k}"),
    benchmark:
        benchmark_path("evaluate/drafter_k{k}")
    wildcard_constraints:
        k=r"\d+",
    conda:
        CONDA_ENV
    threads: measurement_threads()
    resources:
        gpu=RUN.gpu_slot,
    params:
        tracked=tracked("evaluate_drafter"),
        config=RUN_CONFIG,
        stage="evaluate_drafter",
        phases="",
    shell:
        "python -m draftsmith.evaluate --settings {params.config:q} --stage {params.stage} {params.phases}"
        " --prompts {input.prompts:q} --drafter {input.drafter:q} --num-speculative-tokens {wildcards.k}"
        " --output {output:q} --granted-gpus {resources.gpu} > {log:q} 2>&1"


# Each other kind of drafter (training.kinds), at every draft length, measured like EAGLE-3's.
use rule evaluate_drafter as evaluate_kind with:
    input:
        prompts=path(LAYOUT.evaluation_prompts),
        drafter=path(LAYOUT.kind_drafter("{kind}")),
        model=target_model_input(),
    output:
        path(LAYOUT.kind_measurement("{kind}", "{k}")),
    log:
        log_path("evaluate/{kind}_k{k}"),
    benchmark:
        benchmark_path("evaluate/{kind}_k{k}")
    wildcard_constraints:
        kind=KIND_NAMES,
        k=r"\d+",
    params:
        tracked=tracked("evaluate_kind"),
        config=RUN_CONFIG,
        stage="evaluate_kind",
        phases=lambda wildcards: f"--kind {wildcards.kind}",


# The wiring proof: the same drafter shape, never trained, at the default draft length,
# greedy and at the default concurrency only.
use rule evaluate_drafter as evaluate_untrained with:
    input:
        prompts=path(LAYOUT.evaluation_prompts),
        drafter=path(LAYOUT.untrained_drafter),
        model=target_model_input(),
    output:
        path(LAYOUT.untrained_measurement("{k}")),
    log:
        log_path("evaluate/untrained_k{k}"),
    benchmark:
        benchmark_path("evaluate/untrained_k{k}")
    params:
        tracked=tracked("evaluate_untrained"),
        config=RUN_CONFIG,
        stage="evaluate_untrained",
        phases="--default-only",


# The starting drafter (training.from_pretrained), before the run's data: every draft length,
# measured like the drafter it became.
use rule evaluate_drafter as evaluate_start with:
    input:
        prompts=path(LAYOUT.evaluation_prompts),
        drafter=path(LAYOUT.start_drafter),
        model=target_model_input(),
    output:
        path(LAYOUT.start_measurement("{k}")),
    log:
        log_path("evaluate/start_k{k}"),
    benchmark:
        benchmark_path("evaluate/start_k{k}")
    params:
        tracked=tracked("evaluate_start"),
        config=RUN_CONFIG,
        stage="evaluate_start",
        phases="--start",


# The methods that need no training (evaluation.free_methods), one job per method and draft
# length: what a user gets from vLLM for free, measured like the drafter.
rule evaluate_free_method:
    input:
        prompts=path(LAYOUT.evaluation_prompts),
        model=target_model_input(),
    output:
        path(LAYOUT.free_method_measurement("{method}", "{k}")),
    log:
        log_path("evaluate/{method}_k{k}"),
    benchmark:
        benchmark_path("evaluate/{method}_k{k}")
    wildcard_constraints:
        method=FREE_METHOD_NAMES,
        k=r"\d+",
    conda:
        CONDA_ENV
    threads: measurement_threads()
    resources:
        gpu=RUN.gpu_slot,
    params:
        tracked=tracked("evaluate_free_method"),
        config=RUN_CONFIG,
    shell:
        "python -m draftsmith.evaluate --settings {params.config:q} --stage evaluate_free_method"
        " --prompts {input.prompts:q} --method {wildcards.method} --num-speculative-tokens {wildcards.k}"
        " --output {output:q} --granted-gpus {resources.gpu} > {log:q} 2>&1"


rule evaluate:
    input:
        baseline=path(LAYOUT.baseline_measurement),
        drafter_jobs=drafter_measurements(),
        untrained=untrained_measurement_input(),
        free_method_jobs=free_method_measurements(),
        kind_jobs=kind_measurements(),
        start_jobs=start_measurements(),
    output:
        acceptance=path(LAYOUT.acceptance),
        spec_config=path(LAYOUT.speculative_config),
        acceptance_plot=report(
            path(LAYOUT.acceptance_plot),
            caption="../report/acceptance.rst",
            category="Evaluation",
        ),
        speedup_plot=report(
            path(LAYOUT.speedup_plot),
            caption="../report/speedup.rst",
            category="Evaluation",
        ),
        tables=report(
            path(LAYOUT.evaluation_tables),
            caption="../report/evaluation_tables.rst",
            category="Evaluation",
        ),
    log:
        log_path("evaluate/summary"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        tracked=tracked("evaluate"),
        config=RUN_CONFIG,
        untrained=lambda wildcards, input: (
            f"--untrained {shlex.quote(input.untrained[0])}" if input.untrained else ""
        ),
        free_methods=lambda wildcards, input: (
            f"--free-method-jobs {shlex.join(input.free_method_jobs)}"
            if input.free_method_jobs
            else ""
        ),
        kinds=lambda wildcards, input: (
            f"--kind-jobs {shlex.join(input.kind_jobs)}" if input.kind_jobs else ""
        ),
        start=lambda wildcards, input: (
            f"--start-jobs {shlex.join(input.start_jobs)}" if input.start_jobs else ""
        ),
    shell:
        "python -m draftsmith.evaluation_summary --settings {params.config:q}"
        " --baseline {input.baseline:q} --drafter-jobs {input.drafter_jobs:q} {params.untrained} {params.free_methods}"
        " {params.kinds} {params.start}"
        " --acceptance {output.acceptance:q}"
        " --spec-config {output.spec_config:q} --acceptance-plot {output.acceptance_plot:q}"
        " --speedup-plot {output.speedup_plot:q} --tables {output.tables:q} > {log:q} 2>&1"


# Served acceptance against what validation predicts, and the checks that explain a gap
# (acceptance_gap.py): seconds, from what the run already has.
rule diagnose_gap:
    input:
        acceptance=path(LAYOUT.acceptance),
        drafter=path(LAYOUT.drafter),
        dataset=path(LAYOUT.dataset),
        questions=[path(LAYOUT.question_shard(shard)) for shard in QUESTION_SHARDS],
        completions=completion_shards(),
        hidden_states=extraction_shards(),
        model=target_model_input(),
    output:
        report(
            path(LAYOUT.acceptance_gap),
            caption="../report/acceptance_gap.rst",
            category="Evaluation",
        ),
    log:
        log_path("evaluate/gap"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        tracked=tracked("diagnose_gap"),
        config=RUN_CONFIG,
        questions=lambda wildcards, input: os.path.dirname(input.questions[0]),
        hidden_states=lambda wildcards, input: (
            f"--hidden-states {shlex.join(input.hidden_states)}"
            if input.hidden_states
            else ""
        ),
    shell:
        "python -m draftsmith.acceptance_gap --settings {params.config:q}"
        " --acceptance {input.acceptance:q} --drafter {input.drafter:q} --dataset {input.dataset:q}"
        " --questions {params.questions:q} --completions {input.completions:q} {params.hidden_states}"
        " --output {output:q} > {log:q} 2>&1"
