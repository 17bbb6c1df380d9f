"""Remote GPU execution (profiles/remote-gpu): the laptop side (client), the host's (agent)."""
