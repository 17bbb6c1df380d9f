"""Rule smoke_check: argument plumbing for eagleflow.smoke.check."""

from eagleflow.smoke import check
from eagleflow.stage import stage

with stage(snakemake) as sm:
    check(
        sm.input.target,
        sm.input.certificate,
        {"speculators": sm.input.speculators, "sglang": sm.input.sglang},
        sm.input.train,
        sm.input.acceptance,
        [sm.input.records],
        sm.params.benchmark,
        sm.params.smoke,
        sm.params.sglang_version,
        sm.output.verdict,
    )
