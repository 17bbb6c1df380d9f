"""Rule tokenize: argument plumbing for eagleflow.data.tokenize.tokenize."""

from eagleflow.data.tokenize import tokenize
from eagleflow.stage import stage

with stage(snakemake) as sm:
    tokenize(
        sm.input.target,
        sm.input.conversations,
        sm.params.tokenize,
        sm.output.dataset,
        sm.output.token_freq,
        sm.output.stats,
    )
