"""Rule plot_results: argument plumbing for eagleflow.report.plots.plot_results."""

from eagleflow.report.plots import plot_results
from eagleflow.stage import stage

with stage(snakemake) as sm:
    plot_results(
        dict(sm.input.items()),
        sm.params.report,
        sm.output.plots,
        sm.params.benchmark,
        out_table=sm.output.table,
    )
