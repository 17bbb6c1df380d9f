"""Rule regenerate: argument plumbing for eagleflow.data.regenerate.regenerate."""

from eagleflow.data.regenerate import regenerate
from eagleflow.layers import check_layers  # codehash: check only
from eagleflow.stage import stage

with stage(snakemake) as sm:
    # the first stage after prepare_target: a bad layer id fails here, in seconds, not after
    # hours of regeneration (read from the config, not params: its hash is extraction's)
    check_layers(sm.config, sm.input.target)
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
