if RUN.target.build_demo:

    rule demo_model:
        output:
            directory(RUN.target.model),
        log:
            log_path("demo_model"),
        benchmark:
            benchmark_path("demo_model")
        conda:
            CONDA_ENV
        # torch trains on every core; without this Snakemake sets OMP_NUM_THREADS=1 and the
        # build took twice as long (DeepSeek target: 718 s for 600 steps on 2 cores).
        threads: every_core()
        params:
            tracked=tracked("demo_model"),
            steps=RUN.target.demo_train_steps,
            architecture=RUN.target.demo_architecture,
        shell:
            "python -m draftsmith.demo_model --output {output:q} --architecture {params.architecture}"
            " --train-seconds 0 --max-steps {params.steps} --seed 0 > {log:q} 2>&1"
