"""Rule eval_answers: argument plumbing for eagleflow.serve.bench.eval_answers."""

from eagleflow.serve.bench import eval_answers
from eagleflow.stage import stage

with stage(snakemake) as sm:
    eval_answers(sm.input.target, sm.params.benchmark, sm.output.answers)
