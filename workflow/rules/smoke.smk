rule smoke_check:
    """The smoke run's verdict (eagleflow smoke): certificate, doctored exports, served vs.
    standalone accept length, and a standalone floor above a random draft's."""
    input:
        target=rules.prepare_target.output.target,
        certificate=rules.verify_layers.output.certificate,
        speculators=rules.export_draft.output.speculators,
        sglang=rules.export_draft.output.sglang,
        train=rules.train_draft.output.summary,
        acceptance=rules.check_acceptance.output.acceptance,
        records=lambda wc: res(layout.BENCH, engine=ENGINE, config=smoke_spec(config)),
    output:
        verdict=res(layout.SMOKE),
    log:
        logs("smoke_check"),
    localrule: True
    params:
        code=code("smoke_check"),
        benchmark=bench_settings(),
        smoke=config["smoke"],
        sglang_version=config["serve"]["sglang"]["version"],
    script:
        "../scripts/smoke_check.py"
