"""05's rows, a chunk at a time: what every writer and count of the export iterates.

The export's rows are a `run.Selection` (04's mix read back `export.chunk_rows` samples at a time,
each with its record) or, for callers that hold them, a plain list of samples. These helpers take
either, so a writer never holds more than one chunk of ids: `chunks_of` (a Selection's chunks as it
reads them; a list as one chunk), `keys_of` and `lengths_of` (the mix's small per-row facts, read
without the ids where the mix has them).
"""

from __future__ import annotations

from typing import Any, Iterator


def chunks_of(samples: Any) -> Iterator[list[Any]]:
    """The rows in order, a list at a time: a Selection's chunks (read as asked), a list as one chunk."""
    if hasattr(samples, "chunks"):
        yield from samples.chunks()
    elif rows := list(samples):
        yield rows


def keys_of(samples: Any) -> list[Any]:
    """Each row's key, in order."""
    return list(samples.keys) if hasattr(samples, "entries") else [s.key for s in samples]


def lengths_of(samples: Any) -> list[int]:
    """Each row's number of tokens, in order."""
    return [e.tokens for e in samples.entries] if hasattr(samples, "entries") else [len(s.input_ids) for s in samples]
