"""Stage 06: what the data is worth: a draft trained on the hand-off, its acceptance length offline and served.

Owns the evaluation prompts and the leak guard (`evalset`), the training loop around speculators'
own draft model (`train`), the offline chain acceptance (`offline`), vLLM serving with and without
the draft (`engine`), the plan, variants and summary (`run`), the `online` variant's states generated
while it trains (`online`) and the table and figures (`plots`).
May import the core and every earlier stage.
"""
