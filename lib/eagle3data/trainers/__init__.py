"""The drafter trainers 04 and 05 write for, one module each: SpecForge (`specforge`), speculators (`speculators`).

Each trainer module owns that trainer's on-disk contract: the final state it trains on
(SpecForge post-norm, speculators pre-norm), its per-sample file (writer, reader, ids and
metadata), its hand-off names, its vocabulary and other hand-off files, and what linking
instead of converting needs; `base` holds what they share and `registry` the one table of
trainers (`TRAINERS`, `get_trainer`) that params, 04's store, the hand-off and the export ask.
A new trainer is a new module plus its line in `registry`. May import only the core.
"""
