if RUN.target.gguf:

    # A target held as a GGUF file becomes the checkpoint folder at target.model.
    rule gguf_target:
        input:
            RUN.target.gguf,
        output:
            directory(RUN.target.model),
        log:
            log_path("gguf_target"),
        benchmark:
            benchmark_path("gguf_target")
        conda:
            CONDA_ENV
        params:
            tracked=tracked("gguf_target"),
            dtype=RUN.target.gguf_dtype,
        shell:
            "python -m draftsmith.gguf_target --gguf {input:q} --dtype {params.dtype}"
            " --output {output:q} > {log:q} 2>&1"
