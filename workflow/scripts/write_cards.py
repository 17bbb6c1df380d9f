"""Rule write_cards: argument plumbing for eagleflow.report.report.write_cards."""

from eagleflow.report.report import write_cards
from eagleflow.stage import stage

with stage(snakemake) as sm:
    write_cards(dict(sm.input.items()), sm.params.report, sm.output.card, sm.params.benchmark)
