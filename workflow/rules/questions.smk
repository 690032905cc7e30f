rule questions:
    input:
        questions_source_input(),
    output:
        shards=expand(
            f"{RESULTS}/questions/shard_{{shard}}.jsonl", shard=QUESTION_SHARDS
        ),
        heldout=f"{RESULTS}/questions/heldout.jsonl",
        summary=f"{RESULTS}/questions/summary.json",
    log:
        f"{LOGS}/questions.log",
    localrule: True
    conda:
        CONDA_ENV
    params:
        settings=settings("questions"),
        output_dir=lambda wildcards, output: os.path.dirname(output.summary),
    shell:
        "python -m draftsmith.questions --settings {params.settings:q}"
        " --output-dir {params.output_dir:q} > {log:q} 2>&1"
