"""Stage 05: hand the mix and its hidden states to the trainers, in the form their loaders read.

Owns the draft vocabulary (`vocab`), the per-trainer hand-off of stored states, linked or
converted (`handoff`) and the export of token records and conversations (`run`). May import
the core and every earlier stage.
"""
