"""Rule export_dflash: argument plumbing for eagleflow.train.dflash_export.export_dflash."""

from eagleflow.stage import stage
from eagleflow.train.dflash_export import export_dflash

with stage(snakemake) as sm:
    export_dflash(
        sm.input.target,
        sm.input.certificate,
        sm.input.summary,
        sm.params.train,
        sm.params.target_name,
        sm.output.dflash,
    )
