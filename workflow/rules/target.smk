rule prepare_target:
    """Target model folder (from target.path, or built from a packaged GGUF) and target.json."""
    output:
        target=res(layout.TARGET),
    log:
        logs("prepare_target"),
    benchmark:
        bench("prepare_target")
    resources:
        gpu=0,  # no GPU, but the model folder it checks or builds is where the GPU rules run
    params:
        code=code("prepare_target"),
        target=config["target"],
        model_dir=str(Path(BULK, "target", config["target"]["name"])),
    script:
        "../scripts/prepare_target.py"
