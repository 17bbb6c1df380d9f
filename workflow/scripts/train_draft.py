"""Rule train_draft: argument plumbing for eagleflow.train.loop.train_draft."""

from eagleflow.stage import stage
from eagleflow.train.loop import train_draft

# The data loader's workers (train.num_workers > 0) are spawned processes that import this file
# again as __mp_main__, where Snakemake's `snakemake` object does not exist: only the real run
# trains (found on the lent GPU, 2026-12-07: NameError in every worker).
if __name__ == "__main__":
    with stage(snakemake) as sm:
        train_draft(
            dict(sm.input.items()),
            sm.params.train,
            sm.params.checkpoint_dir,
            sm.output.summary,
            sm.output.metrics,
            trust_remote_code=sm.params.trust_remote_code,
            stream=sm.params.get("stream"),
        )
