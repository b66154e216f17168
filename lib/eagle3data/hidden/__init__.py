"""Stage 04: the training mix and the target's hidden states for it.

Owns the one selection rule (`mix`), the capture with its one plan, workers, merge and
estimate (`extract`) and the store's files, reader and validation (`store`). May import the
core and the stages before it (`prompts`, `generate`, `rebuild`, `audit`); never `export`.
"""
