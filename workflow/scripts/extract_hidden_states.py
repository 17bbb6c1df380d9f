"""Rule extract_hidden_states: argument plumbing for eagleflow.extract.stream.extract."""

from eagleflow.extract.stream import extract
from eagleflow.stage import stage

# The vllm backend spawns engine processes, which re-import this file: main process only.
if __name__ == "__main__":
    with stage(snakemake) as sm:
        extract(
            sm.input.target,
            sm.input.dataset,
            sm.params.extract,
            sm.params.shard_dir,
            sm.output.manifest,
            sm.params.sglang_version,
            sm.params.engine,
            sm.params.get("probe_samples"),
            sm.params.get("source"),
        )
