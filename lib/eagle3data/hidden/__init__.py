"""Stage 04: the training mix and the target's hidden states for it.

Owns the one selection rule (`mix`), the capture with its one plan, workers and merge
(`extract`), the size estimate and disk check (`estimate`) and the store's files, written and
read by one module, with its reader and validation (`store`). May import the
core and the stages before it (`prompts`, `generate`, `rebuild`, `audit`); never `export`.
"""
