"""Rule train_draft: argument plumbing for eagleflow.train.train_draft."""

from eagleflow.stage import stage
from eagleflow.train import train_draft

with stage(snakemake) as sm:
    train_draft(
        dict(sm.input.items()),
        sm.params.train,
        sm.params.checkpoint_dir,
        sm.output.summary,
        sm.output.metrics,
        trust_remote_code=sm.params.trust_remote_code,
    )
