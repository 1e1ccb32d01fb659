"""The GPT family: decoder-only transformer, causal language-model loss."""
