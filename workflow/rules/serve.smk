rule eval_answers:
    """The target's greedy answers to the first turns: the context of the second turns."""
    input:
        target=rules.prepare_target.output.target,
    output:
        answers=res(layout.ANSWERS),
    log:
        logs("eval_answers"),
    benchmark:
        bench("eval_answers")
    resources:
        gpu=1,
    params:
        code=code("eval_answers"),
        benchmark=bench_settings(standalone=True),
    script:
        "../scripts/eval_answers.py"


rule check_acceptance:
    """Standalone acceptance (EAGLE-3 chains or DFlash blocks): target + draft in-process, no
    server, per position."""
    input:
        target=rules.prepare_target.output.target,
        draft=(
            rules.export_dflash.output.dflash
            if efdflash.enabled(config)
            else rules.export_draft.output.speculators
        ),
        train=rules.train_draft.output.summary,
        answers=eval_answers_input,
    output:
        acceptance=res(layout.ACCEPTANCE),
    log:
        logs("check_acceptance"),
    benchmark:
        bench("check_acceptance")
    threads: 8  # capped at --cores; the target runs in-process, OMP_NUM_THREADS follows it
    resources:
        gpu=1,
    params:
        **({"algorithm": "dflash"} if efdflash.enabled(config) else {}),
        code=code("check_acceptance"),
        benchmark=bench_settings(standalone=True),
        num_steps=sorted({s.num_steps for s in SPEC_CONFIGS if s.num_steps}),
    script:
        "../scripts/check_acceptance.py"


rule serve_and_benchmark:
    """One engine x speculative config: start the server, warm up, measure, stop it."""
    input:
        target=rules.prepare_target.output.target,
        draft=draft_export,
        answers=eval_answers_input,
    output:
        records=res(layout.BENCH),
    log:
        logs("serve_and_benchmark.{engine}.{config}"),
    wildcard_constraints:
        engine="vllm|sglang",
    resources:
        gpu=1,
    params:
        code=code("serve_and_benchmark"),
        serve=config["serve"],
        # The baseline reruns whenever the benchmark settings or the spec list change, so a
        # speedup is only ever computed against a baseline measured under the same conditions.
        benchmark=bench_settings(),
        spec_list=spec_names(),
        spec=lambda wc: vars(spec_by_name(wc.config)),
    script:
        "../scripts/serve_and_benchmark.py"


rule benchmark_endpoint:
    """A server someone else runs: the same prompts and client, nothing started or changed."""
    input:
        target=rules.prepare_target.output.target,
        answers=eval_answers_input,
    output:
        records=res(layout.ENDPOINT),
    log:
        logs("benchmark_endpoint.{endpoint}"),
    localrule: True  # the endpoint is reached from where Snakemake runs
    params:
        code=code("benchmark_endpoint"),
        benchmark=bench_settings(),
        # names and URLs only: an API key stays in the environment variable the config names
        endpoint=lambda wc: ENDPOINTS[wc.endpoint],
        baseline_of=lambda wc: baseline_of(wc.endpoint),
    script:
        "../scripts/benchmark_endpoint.py"
