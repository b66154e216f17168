"""The EAGLE-3 draft vocabulary: the most frequent output tokens of the mix, as d2t/t2d, computed once.

The draft vocabulary is the `draft_vocab_size` most frequent target ids among output tokens
(loss_mask 1), ties broken by the smaller id; when fewer distinct ids exist it is filled with
the smallest unused target ids. The selected ids are sorted ascending and stored as
`d2t[draft_id] = target_id - draft_id` (int64, so `target_id = draft_id + d2t[draft_id]`) and
`t2d[target_id] = True` for selected ids (bool) — the EAGLE-3 / SpecForge / speculators form.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from eagle3data.core.atomic import atomic_path
from eagle3data.core.errors import UserInputError
from eagle3data.export.rows import chunks_of


class VocabError(UserInputError, ValueError):
    """The draft vocabulary cannot be built as asked (a size beyond the target vocabulary, an id outside it)."""


@dataclass
class DraftVocab:
    """EAGLE-3 draft vocabulary: d2t offsets, t2d membership, and how much output it covers."""

    d2t: np.ndarray  # int64 [draft_vocab]
    t2d: np.ndarray  # bool [target_vocab]
    coverage: float
    output_tokens: int
    distinct_output_tokens: int
    filled: int  # ids added (never seen in outputs) to reach the size

    @property
    def draft_ids(self) -> np.ndarray:
        """Target id of each draft id, ascending."""
        return np.arange(len(self.d2t), dtype=np.int64) + self.d2t

    def summary(self) -> dict[str, Any]:
        return {"draft_vocab_size": int(len(self.d2t)), "target_vocab_size": int(len(self.t2d)),
                "coverage": self.coverage, "output_tokens": self.output_tokens,
                "distinct_output_tokens": self.distinct_output_tokens, "filled": self.filled}

def output_token_counts(samples: Iterable[Any], target_vocab_size: int) -> np.ndarray:
    """How often each target id occurs among output tokens (loss_mask 1), as int64 [target_vocab]; a chunk of
    samples at a time (`rows.chunks_of`)."""
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    for chunk in chunks_of(samples):
        add_output_counts(counts, chunk)
    return counts


def add_output_counts(counts: np.ndarray, samples: list[Any]) -> None:
    """Add one chunk's output tokens to `counts` (one bincount for the chunk)."""
    parts = [np.asarray(s.input_ids, dtype=np.int64)[np.asarray(s.loss_mask, dtype=bool)] for s in samples]
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    size = len(counts)
    if ids.size and (ids.min() < 0 or ids.max() >= size):
        s, bad = next((s, p[(p < 0) | (p >= size)]) for s, p in zip(samples, parts) if ((p < 0) | (p >= size)).any())
        raise VocabError(f"sample {s.key}: token id {int(bad[0])} outside the target vocabulary (size {size})")
    counts += np.bincount(ids, minlength=size)


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """d2t/t2d from output-token counts: the most frequent ids, filled with the smallest unused ids."""
    counts = np.asarray(counts, dtype=np.int64)
    target_vocab_size = len(counts)
    if draft_vocab_size > target_vocab_size:
        raise VocabError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocabulary "
                          f"({target_vocab_size} ids)")
    seen = np.flatnonzero(counts)
    # most frequent first, ties by smaller id (lexsort: last key is primary)
    ranked = seen[np.lexsort((seen, -counts[seen]))][:draft_vocab_size]
    filled = draft_vocab_size - len(ranked)
    if filled:
        unused = np.flatnonzero(counts == 0)[:filled]
        ranked = np.concatenate([ranked, unused])
    chosen = np.sort(ranked).astype(np.int64)
    d2t = chosen - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[chosen] = True
    total = int(counts.sum())
    covered = int(counts[chosen].sum())
    return DraftVocab(d2t=d2t, t2d=t2d, coverage=(covered / total) if total else 0.0,
                      output_tokens=total, distinct_output_tokens=int(len(seen)), filled=int(filled))


def coverage_curve(counts: np.ndarray, sizes: Iterable[int]) -> dict[int, float]:
    """Coverage the best draft vocabulary of each size would reach (share of output tokens)."""
    c = np.sort(np.asarray(counts, dtype=np.int64))[::-1].cumsum()
    total = int(c[-1]) if len(c) else 0
    return {int(n): (float(c[min(n, len(c)) - 1]) / total if total and n > 0 else 0.0) for n in sizes}


def save_draft_vocab(vocab: DraftVocab, path: str | Path) -> Path:
    """Write `d2t` (int64) and `t2d` (bool) to a safetensors file."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # the umask's mode: save_file alone makes it 0600
        save_file({"d2t": np.ascontiguousarray(vocab.d2t, dtype=np.int64),
                   "t2d": np.ascontiguousarray(vocab.t2d, dtype=bool)}, str(tmp),
                  metadata={"coverage": f"{vocab.coverage:.6f}", "convention": "target_id = draft_id + d2t[draft_id]"})
    return path


def load_draft_vocab(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read (d2t, t2d) back from a safetensors file written by `save_draft_vocab`."""
    from safetensors.numpy import load_file

    t = load_file(str(path))
    return t["d2t"], t["t2d"]
