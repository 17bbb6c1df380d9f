"""Rules vocab_map, train_draft and export_draft (workflow/rules/train.smk): the draft."""
