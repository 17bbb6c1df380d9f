"""Rules summarize, plot_results and write_cards (workflow/rules/report.smk): the report."""
