"""Stage 03: check every record's token structure, fast, and report it.

Owns the journal as flat id arrays (`idtable`), the vectorized checks (`checks`), verdicts and
the summary (`run`), the sample inspector (`inspector`), figures (`plots`) and the shareable
`report.html` (`report`). May import the core, `prompts`, `generate` and `rebuild`; never a
later stage.
"""
