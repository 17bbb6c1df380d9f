"""Rule prepare_target: argument plumbing for eagleflow.target.prepare.prepare_target."""

from eagleflow.stage import stage
from eagleflow.target.prepare import prepare_target

with stage(snakemake) as sm:
    prepare_target(sm.params.target, sm.params.model_dir, sm.output.target)
