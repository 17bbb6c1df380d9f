"""Rules extract_hidden_states and verify_layers (workflow/rules/extract.smk)."""
