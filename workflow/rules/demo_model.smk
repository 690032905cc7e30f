if config["target"]["build_demo"]:

    rule demo_model:
        output:
            directory(config["target"]["model"]),
        log:
            log_path("demo_model"),
        benchmark:
            benchmark_path("demo_model")
        conda:
            CONDA_ENV
        params:
            tracked=tracked("demo_model"),
            steps=config["target"]["demo_train_steps"],
            architecture=config["target"]["demo_architecture"],
        shell:
            "python -m draftsmith.demo_model --output {output:q} --architecture {params.architecture}"
            " --train-seconds 0 --max-steps {params.steps} --seed 0 > {log:q} 2>&1"
