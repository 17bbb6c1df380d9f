rule extract_hidden_states:
    """Hidden states of the aux layers + pre-norm final slot; shards in data_root, manifest out."""
    input:
        target=rules.prepare_target.output.target,
        dataset=rules.tokenize.output.dataset,
    output:
        manifest=res(layout.MANIFEST),
    log:
        logs("extract_hidden_states"),
    benchmark:
        bench("extract_hidden_states")
    resources:
        gpu=1,
    params:
        # streamed modes capture the certificate's probe rows in this rule
        **({"probe_samples": config["verify"]["probe_samples"]} if STREAM else {}),
        **stream_source(),
        code=code("extract_hidden_states"),
        extract=section("extract"),
        shard_dir=str(Path(BULK, "extract")),
        sglang_version=config["serve"]["sglang"]["version"],
        engine=ENGINE,
    script:
        "../scripts/extract_hidden_states.py"


rule verify_layers:
    """Layer certificate: stored shards vs. forward hooks (and the engine's capture)."""
    input:
        target=rules.prepare_target.output.target,
        dataset=rules.tokenize.output.dataset,
        manifest=rules.extract_hidden_states.output.manifest,
    output:
        certificate=res(layout.CERTIFICATE),
    log:
        logs("verify_layers"),
    resources:
        gpu=1,
    params:
        code=code("verify_layers"),
        verify=section("verify", drop=("recheck_steps",)),
        extract=section("extract"),
        sglang_version=config["serve"]["sglang"]["version"],
        engine=ENGINE,
        sglang=config["serve"]["sglang"],
    script:
        "../scripts/verify_layers.py"
