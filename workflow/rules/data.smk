rule prepare_prompts:
    """Training prompts from local files (datasets), deduped, filtered, sampled, eval-free."""
    output:
        prompts=res(layout.PROMPTS),
        stats=res(layout.PROMPTS_STATS),
    log:
        logs("prepare_prompts"),
    localrule: True
    params:
        code=code("prepare_prompts"),
        data=config["data"],
    script:
        "../scripts/prepare_prompts.py"


rule regenerate:
    """Responses written by the target itself through its serving engine (resumable)."""
    input:
        target=rules.prepare_target.output.target,
        prompts=rules.prepare_prompts.output.prompts,
    output:
        conversations=res(layout.REGENERATED),
        stats=res(layout.REGENERATED_STATS),
    log:
        logs("regenerate"),
    benchmark:
        bench("regenerate")
    resources:
        gpu=1,
    params:
        code=code("regenerate"),
        regenerate=config["regenerate"],
        serve=efengines.regeneration_settings(config["serve"]),
        work_dir=str(Path(BULK, "regenerate")),
    script:
        "../scripts/regenerate.py"


rule tokenize:
    """Chat-template rendering, loss mask on assistant tokens, speculators dataset, token counts."""
    input:
        target=rules.prepare_target.output.target,
        conversations=rules.regenerate.output.conversations,
    output:
        dataset=directory(res(layout.TOKENIZED)),
        token_freq=res(layout.TOKEN_FREQ),
        stats=res(layout.TOKENIZED_STATS),
    log:
        logs("tokenize"),
    benchmark:
        bench("tokenize")
    resources:
        gpu=0,  # no GPU, but it reads the tokenizer from the target folder, on the GPU host
    params:
        code=code("tokenize"),
        tokenize=config["tokenize"],
    script:
        "../scripts/tokenize.py"
