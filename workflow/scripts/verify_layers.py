"""Rule verify_layers: argument plumbing for eagleflow.layers.verify_layers."""

from eagleflow.layers import verify_layers
from eagleflow.stage import stage

with stage(snakemake) as sm:
    verify_layers(
        sm.input.target,
        sm.input.dataset,
        sm.input.manifest,
        sm.params.verify,
        sm.params.extract,
        sm.params.sglang_version,
        sm.output.certificate,
    )
