"""Rule regenerate: argument plumbing for eagleflow.data.regenerate."""

from eagleflow.data import regenerate
from eagleflow.stage import stage

with stage(snakemake) as sm:
    regenerate(
        sm.input.target,
        sm.input.prompts,
        sm.params.regenerate,
        sm.params.serve,
        sm.params.work_dir,
        sm.output.conversations,
        sm.output.stats,
        sm.log[0],
    )
