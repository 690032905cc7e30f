rule questions:
    input:
        source=questions_source_input(),
        model=target_model_input(),  # prompts are measured in its tokens
    output:
        shards=[path(LAYOUT.question_shard(shard)) for shard in QUESTION_SHARDS],
        heldout=path(LAYOUT.heldout),
        summary=path(LAYOUT.questions_summary),
    log:
        log_path("questions"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        tracked=tracked("questions"),
        config=RUN_CONFIG,
        output_dir=lambda wildcards, output: os.path.dirname(output.summary),
    shell:
        "python -m draftsmith.questions --settings {params.config:q}"
        " --output-dir {params.output_dir:q} > {log:q} 2>&1"
