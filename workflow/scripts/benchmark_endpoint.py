"""Rule benchmark_endpoint: argument plumbing for eagleflow.serve.bench.benchmark_endpoint."""

from eagleflow.serve.bench import benchmark_endpoint
from eagleflow.stage import stage
from eagleflow.target.prepare import load_target_json

with stage(snakemake) as sm:
    target = load_target_json(sm.input.target)
    benchmark_endpoint(
        target["path"],
        sm.params.endpoint,
        sm.params.benchmark,
        sm.output.records,
        baseline_of=sm.params.baseline_of,
        trust_remote_code=bool(target.get("trust_remote_code")),
        answers=sm.input.answers or None,
    )
