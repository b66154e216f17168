"""Stage 02: rebuild token ids from API text and say how far each record is proven.

Owns the rebuild of ids and its proof levels (`text`), the provider's per-token output mapped
to ids (`provider_tokens`) and the stage over a run with drift measurement (`run`). May import
the core, `prompts` and `generate`; never a later stage.
"""
