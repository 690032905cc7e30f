if config["target"]["build_demo"]:

    rule demo_model:
        output:
            directory(config["target"]["model"]),
        log:
            f"{LOGS}/demo_model.log",
        conda:
            CONDA_ENV
        params:
            seconds=config["target"]["demo_train_seconds"],
        shell:
            "python -m draftsmith.demo_model --output {output:q}"
            " --train-seconds {params.seconds} --seed 0 > {log:q} 2>&1"
