"""Rule summarize: argument plumbing for eagleflow.report.table.summarize."""

from eagleflow.report.table import summarize
from eagleflow.stage import stage

with stage(snakemake) as sm:
    summarize(dict(sm.input.items()), sm.params.benchmark, sm.output.csv, sm.output.md)
