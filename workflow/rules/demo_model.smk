if config["target"]["build_demo"]:

    rule demo_model:
        output:
            directory(config["target"]["model"]),
        log:
            f"{LOGS}/demo_model.log",
        conda:
            CONDA_ENV
        params:
            steps=config["target"]["demo_train_steps"],
        shell:
            "python -m draftsmith.demo_model --output {output:q}"
            " --train-seconds 0 --max-steps {params.steps} --seed 0 > {log:q} 2>&1"
