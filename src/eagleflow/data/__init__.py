"""Rules prepare_prompts, regenerate and tokenize (workflow/rules/data.smk): the training data."""
