"""Rule write_cards: argument plumbing for eagleflow.report.cards.write_cards."""

from eagleflow.report.cards import write_cards
from eagleflow.stage import stage

with stage(snakemake) as sm:
    write_cards(dict(sm.input.items()), sm.params.report, sm.output.card, sm.params.benchmark)
