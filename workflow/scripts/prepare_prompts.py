"""Rule prepare_prompts: argument plumbing for eagleflow.data.prompts.prepare_prompts."""

from eagleflow.data.prompts import prepare_prompts
from eagleflow.stage import stage

with stage(snakemake) as sm:
    prepare_prompts(sm.params.data, sm.output.prompts, sm.output.stats)
