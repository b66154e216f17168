"""The core every stage uses: params, the model's turn (profiles), the run's records and its one reader.

Owns the strict params of every stage (`params`), model profiles and the one split of output
ids (`profiles`, `spans`), the journal (`records`) and the one reader of a run with its one
sample key (`reader.SampleKey.of(row)`), what ran (`provenance`), model and tokenizer loading
(`models`), honest bounds (`stats`), the live progress line (`progress`), the one base of
user errors (`errors`), the one atomic write with the umask's mode (`atomic`), the run folder's one
writer (`runlock`) and the kernel's read-ahead of files about to be read (`readahead`). May import
only itself (and the two registries whose names the params validate: `prompts.formats` and
`trainers.registry`); every other package imports it.
"""
