"""Stage 04: the training mix and the target's hidden states for it.

Owns the one selection rule (`mix`), the capture with its one plan, workers and merge
(`extract`, `merge`), the size estimate and disk check (`estimate`), a final norm outside the
model (`norms`), and three subpackages: the store's files, written and read by its package alone
(`store`: format, writer, index, reader, validation), the capture through a serving engine
(`engines`) and the proof that the stored states are the target's (`verify`). May import the
core and the stages before it (`prompts`, `generate`, `rebuild`, `audit`); never `export`.
"""
