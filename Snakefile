# eagleflow: target + conversations -> EAGLE-3 draft, proven wired like the server, served, measured.
# Wiring only: every algorithm lives in src/eagleflow, every helper in workflow/rules/common.smk.
from snakemake.utils import min_version

min_version("9.20")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/serve.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/smoke.smk"


rule all:
    default_target: True
    input:
        rules.summarize.output,
        rules.plot_results.output,
        rules.write_cards.output,
