"""Rule export_draft: argument plumbing for eagleflow.train.export.export_draft."""

from eagleflow.stage import stage
from eagleflow.train.export import export_draft

with stage(snakemake) as sm:
    export_draft(
        sm.input.target,
        sm.input.certificate,
        sm.input.summary,
        sm.params.train,
        sm.params.target_name,
        sm.output.speculators,
        sm.output.sglang,
    )
