"""Stage 03: check every record's token structure, fast, and report it.

Owns the journal as flat id arrays (`idtable`), a run's tables merged with 02's ids and split by
the supersede rule (`runtable`), 02's rebuilt ids read by key (`rebuilt`), the vectorized checks
(`checks`) and the tokenizer's in batches (`textchecks`), a run audited in chunks with memory set by
`audit.chunk_records` (`streamed`), verdicts and
the summary (`run`), `python -m eagle3data audit` on any journal, streamed the same way (`command`),
the sample inspector (`inspector`), figures (`plots`) and the shareable
`report.html` (`report`), which opens on the run's summary across the stages that ran (`overview`). May import the core, `prompts`, `generate` and `rebuild`; never a
later stage.
"""
