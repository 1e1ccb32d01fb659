"""Data pipeline: tokenizers, the `.bin/.idx` indexed dataset, and GPT sample building."""
