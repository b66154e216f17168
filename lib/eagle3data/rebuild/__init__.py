"""Stage 02: rebuild token ids from API text and say how far each record is proven.

Owns the proof vocabulary (`proof`: flags, levels, `Rebuilt`), the text assembled as the
model's turn (`assemble`), the batched encode and its verification (`text`), the provider's
per-token output mapped to ids (`provider_tokens`) and the stage over a run with drift
measurement (`run`). May import
the core, `prompts` and `generate`; never a later stage.
"""
