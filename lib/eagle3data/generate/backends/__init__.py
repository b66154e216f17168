"""Backends that turn templated prompts into records: local (in-process HF), sglang, openai."""
