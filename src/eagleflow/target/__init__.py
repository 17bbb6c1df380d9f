"""Rule prepare_target (workflow/rules/target.smk): the target model and its target.json."""
