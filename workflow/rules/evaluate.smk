rule evaluate:
    input:
        heldout=path(LAYOUT.heldout),
        drafter=path(LAYOUT.drafter),
        untrained=untrained_drafter_input(),
        model=target_model_input(),
    output:
        acceptance=path(LAYOUT.acceptance),
        spec_config=path(LAYOUT.speculative_config),
        plot=report(
            path(LAYOUT.acceptance_plot),
            caption="../report/acceptance.rst",
            category="Evaluation",
        ),
    log:
        log_path("evaluate"),
    benchmark:
        benchmark_path("evaluate")
    conda:
        CONDA_ENV
    resources:
        gpu=config["gpu_slot"],
    params:
        tracked=tracked("evaluate"),
        config=RUN_CONFIG,
        untrained=lambda wildcards, input: (
            f"--untrained-drafter {shlex.quote(input.untrained[0])}"
            if input.untrained
            else ""
        ),
    shell:
        "python -m draftsmith.evaluate --settings {params.config:q}"
        " --heldout {input.heldout:q} --drafter {input.drafter:q} {params.untrained}"
        " --spec-config {output.spec_config:q} --output {output.acceptance:q}"
        " --plot {output.plot:q} --granted-gpus {resources.gpu} > {log:q} 2>&1"
