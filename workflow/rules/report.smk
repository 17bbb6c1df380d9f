rule summarize:
    """One tidy table: throughput, speedup, served vs. standalone accept length, verdict."""
    input:
        records=expand(
            res(layout.BENCH),
            engine=ENGINE,
            config=spec_names(),
        )
        + endpoint_records(),
        acceptance=rules.check_acceptance.output.acceptance,
        train=rules.train_draft.output.summary,
        manifest=rules.extract_hidden_states.output.manifest,
    output:
        csv=report(
            res(layout.SUMMARY_CSV),
            caption="../report/summary.rst",
            category="Summary",
        ),
        md=res(layout.SUMMARY_MD),
    log:
        logs("summarize"),
    localrule: True
    params:
        code=code("summarize"),
        benchmark=bench_settings(),
    script:
        "../scripts/summarize.py"


rule plot_results:
    """Speedup, accept length, per-position acceptance, training, concurrency, extraction plots;
    the summary table as HTML for the report."""
    input:
        summary=rules.summarize.output.csv,
        acceptance=rules.check_acceptance.output.acceptance,
        metrics=rules.train_draft.output.metrics,
        manifest=rules.extract_hidden_states.output.manifest,
        train=rules.train_draft.output.summary,
        data_size=[
            e[k]
            for e in config["report"]["data_size"]
            for k in ("acceptance", "train_summary")
            if e.get(k)
        ],
        levers=[
            e[k]
            for e in config["report"]["levers"]
            for k in ("acceptance", "train_summary")
            if e.get(k)
        ],
    output:
        # one report item per plot, in the first configured format (plots.json is the index)
        plots=report(
            directory(res(layout.PLOTS)),
            patterns=[f"{{plot}}.{config['report']['formats'][0]}"],
            caption="../report/plots.rst",
            category="Plots",
            labels={"plot": "{plot}"},
        ),
        # the table again, as HTML: the report shows HTML inline but offers a CSV as a download
        table=report(
            res(layout.SUMMARY_HTML),
            caption="../report/summary.rst",
            category="Summary",
        ),
    log:
        logs("plot_results"),
    localrule: True
    params:
        code=code("plot_results"),
        report=config["report"],
        benchmark=bench_settings(),
    script:
        "../scripts/plot_results.py"


rule write_cards:
    """Model card with the measured figures (under results/cards; exports are never rewritten)."""
    input:
        summary=rules.summarize.output.csv,
        speculators=(  # the export whose README the card extends
            rules.export_dflash.output.dflash
            if efdflash.enabled(config)
            else rules.export_draft.output.speculators
        ),
        certificate=rules.verify_layers.output.certificate,
        acceptance=rules.check_acceptance.output.acceptance,
        train=rules.train_draft.output.summary,
    output:
        card=report(
            res(layout.CARD, target=config["target"]["name"]),
            caption="../report/card.rst",
            category="Model card",
        ),
    log:
        logs("write_cards"),
    localrule: True
    params:
        code=code("write_cards"),
        report=config["report"],
        benchmark=bench_settings(),
    script:
        "../scripts/write_cards.py"
