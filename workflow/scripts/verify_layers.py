"""Rule verify_layers: argument plumbing for eagleflow.extract.certificate.verify_layers."""

from eagleflow.extract.certificate import verify_layers
from eagleflow.stage import stage

# vLLM spawns its engine processes, which re-import this file: run only in the main process.
if __name__ == "__main__":
    with stage(snakemake) as sm:
        verify_layers(
            sm.input.target,
            sm.input.dataset,
            sm.input.manifest,
            sm.params.verify,
            sm.params.extract,
            sm.params.sglang_version,
            sm.output.certificate,
            sm.params.engine,
            sm.params.sglang,
        )
