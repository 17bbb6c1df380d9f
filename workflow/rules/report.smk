rule summarize:
    """One tidy table: throughput, speedup, served vs. standalone accept length, verdict."""
    input:
        records=expand(
            res("bench", "{engine}", "{config}.json"),
            engine=ENGINE,
            config=spec_names(),
        ),
        acceptance=rules.check_acceptance.output.acceptance,
        train=rules.train_draft.output.summary,
        manifest=rules.extract_hidden_states.output.manifest,
    output:
        csv=report(
            res("summary.csv"), caption="../report/summary.rst", category="Summary"
        ),
        md=res("summary.md"),
    log:
        logs("summarize"),
    localrule: True
    params:
        code=code("summarize"),
        benchmark=config["benchmark"],
    script:
        "../scripts/summarize.py"


rule plot_results:
    """Speedup, accept length, per-position acceptance, training curves, concurrency plots."""
    input:
        summary=rules.summarize.output.csv,
        acceptance=rules.check_acceptance.output.acceptance,
        metrics=rules.train_draft.output.metrics,
    output:
        plots=report(
            directory(res("plots")),
            patterns=["{name}.png"],
            caption="../report/plots.rst",
            category="Plots",
        ),
    log:
        logs("plot_results"),
    localrule: True
    params:
        code=code("plot_results"),
        report=config["report"],
    script:
        "../scripts/plot_results.py"


rule write_cards:
    """Model card with the measured figures (under results/cards; exports are never rewritten)."""
    input:
        summary=rules.summarize.output.csv,
        speculators=rules.export_draft.output.speculators,
        certificate=rules.verify_layers.output.certificate,
    output:
        card=res("cards", f"{config['target']['name']}-eagle3.md"),
    log:
        logs("write_cards"),
    localrule: True
    params:
        code=code("write_cards"),
        report=config["report"],
    script:
        "../scripts/write_cards.py"
