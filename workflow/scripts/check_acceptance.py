"""Rule check_acceptance: argument plumbing for eagleflow.serve.acceptance.check_acceptance."""

from eagleflow.serve.acceptance import check_acceptance
from eagleflow.stage import stage

with stage(snakemake) as sm:
    check_acceptance(
        sm.input.target,
        sm.input.draft,
        sm.params.benchmark,
        sm.params.num_steps,
        sm.output.acceptance,
        train_summary=sm.input.train,
        answers=sm.input.answers or None,
        algorithm=sm.params.get("algorithm", "eagle3"),
    )
