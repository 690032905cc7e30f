rule evaluate:
    input:
        heldout=f"{RESULTS}/questions/heldout.jsonl",
        drafter=f"{RESULTS}/drafter",
        spec_config=f"{RESULTS}/drafter_speculative_config.json",
        untrained=untrained_baseline_input(),
        model=target_model_input(),
    output:
        acceptance=f"{RESULTS}/eval/acceptance.json",
        plot=report(
            f"{RESULTS}/eval/acceptance.png",
            caption="../report/acceptance.rst",
            category="Evaluation",
        ),
    log:
        f"{LOGS}/evaluate.log",
    conda:
        CONDA_ENV
    resources:
        gpu=config["gpu_slot"],
    params:
        settings=settings("target", "server", "evaluation", "device", "gpu_slot"),
        untrained=lambda wildcards, input: (
            f"--untrained-spec-config {shlex.quote(input.untrained[0])}"
            if input.untrained
            else ""
        ),
        versions=software_versions(),
    shell:
        "python -m draftsmith.evaluate --settings {params.settings:q}"
        " --heldout {input.heldout:q} --spec-config {input.spec_config:q}"
        " --output {output.acceptance:q} --plot {output.plot:q} {params.untrained}"
        " --granted-gpus {resources.gpu} > {log:q} 2>&1"
