rule vocab_map:
    """Draft vocabulary (d2t / t2d) from token frequencies over loss-masked tokens, or the
    init draft's own (train.init_from)."""
    input:
        target=rules.prepare_target.output.target,
        token_freq=rules.tokenize.output.token_freq,
        init_from=init_from_files,
    output:
        d2t=res(layout.D2T, draft_vocab_size=config["train"]["draft_vocab_size"]),
        t2d=res(layout.T2D, draft_vocab_size=config["train"]["draft_vocab_size"]),
    log:
        logs("vocab_map"),
    localrule: True
    params:
        code=code("vocab_map"),
        draft_vocab_size=config["train"]["draft_vocab_size"],
        init_from=config["train"]["init_from"],
    script:
        "../scripts/vocab_map.py"


rule train_draft:
    """Draft training with speculators, EAGLE-3 or DFlash (resumable; checkpoints in data_root)."""
    input:
        target=rules.prepare_target.output.target,
        dataset=rules.tokenize.output.dataset,
        manifest=rules.extract_hidden_states.output.manifest,
        certificate=rules.verify_layers.output.certificate,
        d2t=rules.vocab_map.output.d2t,
        t2d=rules.vocab_map.output.t2d,
        init_from=init_from_files,
    output:
        summary=res(layout.TRAIN_SUMMARY),
        metrics=res(layout.TRAIN_METRICS),
    log:
        logs("train_draft"),
    benchmark:
        bench("train_draft")
    threads: 8  # capped at --cores; Snakemake sets OMP_NUM_THREADS from it (2 threads: 1.8x 1 here)
    resources:
        gpu=config["train"]["gpus"] + config["extract"]["gpus"],  # a capture server's own
    params:
        **(
            {
                "stream": {
                    "recheck_steps": config["verify"]["recheck_steps"],
                    **stream_source(),
                }
            }
            if STREAM
            else {}
        ),
        code=code("train_draft"),
        train=train_params(),
        checkpoint_dir=str(Path(BULK, "checkpoints")),
        trust_remote_code=config["target"]["trust_remote_code"],
    script:
        "../scripts/train_draft.py"


rule export_draft:
    """Best checkpoint -> speculators format (vLLM) and SGLang format, each doctored."""
    input:
        target=rules.prepare_target.output.target,
        certificate=rules.verify_layers.output.certificate,
        summary=rules.train_draft.output.summary,
    output:
        speculators=directory(res(layout.EXPORT_SPECULATORS)),
        sglang=directory(res(layout.EXPORT_SGLANG)),
    log:
        logs("export_draft"),
    resources:
        gpu=0,  # no GPU, but it reads the best checkpoint in data_root: runs where training ran
    params:
        code=code("export_draft"),
        train=config["train"],
        target_name=config["target"]["name"],
    script:
        "../scripts/export_draft.py"


rule export_dflash:
    """Best DFlash checkpoint -> the native folder vLLM and SGLang load (draft.algorithm dflash)."""
    input:
        target=rules.prepare_target.output.target,
        certificate=rules.verify_layers.output.certificate,
        summary=rules.train_draft.output.summary,
    output:
        dflash=directory(res(layout.EXPORT_DFLASH)),
    log:
        logs("export_dflash"),
    resources:
        gpu=0,  # no GPU, but it reads the best checkpoint in data_root: runs where training ran
    params:
        code=code("export_dflash"),
        train=train_params(),
        target_name=config["target"]["name"],
    script:
        "../scripts/export_dflash.py"
