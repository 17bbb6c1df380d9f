"""Rule serve_and_benchmark: argument plumbing for eagleflow.serve.bench.serve_and_benchmark."""

from eagleflow.serve.bench import serve_and_benchmark
from eagleflow.stage import stage

with stage(snakemake) as sm:
    serve_and_benchmark(
        sm.input.target,
        sm.input.draft or None,
        sm.params.serve,
        sm.params.benchmark,
        sm.params.spec,
        sm.output.records,
        sm.log[0],
        answers=sm.input.answers or None,
    )
