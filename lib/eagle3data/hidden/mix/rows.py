"""The training mix's rows: what the rule keeps of each sample, and the run read as a stream to make them.

The rule (`hidden.mix`) sees every record but keeps only small facts per sample (`Entry`: key,
source, lengths, a digest of its ids for dedupe), never the ids. `RunRows` gives it the run as a
stream (`core.stream`: each journal's lines in order, parsed only where a sample may come from,
02's rebuilt lines and 03's verdicts by key) and reads any sample again by key; `Records` reads
journal lines by key, a chunk of keys at a time, forward through each journal. The steps over the
facts that need more than one sample live here too: `last_turns` (`hidden.train_turns: last`) and
`turn_figures` (what per-turn sequences cost, reading the turns' ids a chunk of conversations at a time).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from eagle3data.core.reader import RunFileError, Sample, SampleKey, read_verdicts, resolve
from eagle3data.core.stream import JournalIndex, index_journal, index_rebuilt


@dataclass(slots=True)
class Entry:
    """What the mix keeps of a sample while it decides: never its ids, a digest of them (dedupe compares content)."""

    key: SampleKey
    source: str
    ids_exact: bool
    tokens: int
    loss_tokens: int
    digest: bytes = b""
    conv: tuple[str, int] | None = None  # a turn sample's conversation (sample_id) and turn

    @property
    def dataset(self) -> str:
        return self.key.dataset


def entry(s: Sample, conv: tuple[str, int] | None = None, key: SampleKey | None = None) -> Entry:
    """A sample's facts (`key`: its key object where one is held already, not made again)."""
    ids = np.asarray(s.input_ids, dtype=np.int64)
    return Entry(key or s.key, s.source, s.ids_exact, len(ids), int(sum(s.loss_mask)),
                 hashlib.blake2b(ids.tobytes(), digest_size=16).digest(), conv)


class Records:
    """The records (journal lines) of keys, in the order asked, read by seek and forward through each journal."""

    def __init__(self, journals: Mapping[str, JournalIndex]) -> None:
        self.journals, self._where = journals, {}  # per journal: key -> line of its record (made when first asked)

    def __contains__(self, key: SampleKey) -> bool:
        return key in self._lines(key.dataset)

    def _lines(self, name: str) -> dict[SampleKey, int]:
        if name not in self._where:
            idx = self.journals.get(name)
            self._where[name] = {} if idx is None else {idx.keys[i]: int(i) for i in idx.record_lines()}
        return self._where[name]

    def __call__(self, keys: list[SampleKey]) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = [None] * len(keys)
        for name, want in itertools.groupby(sorted((k.dataset, i) for i, k in enumerate(keys)), key=lambda x: x[0]):
            where = self._lines(name)
            pairs = sorted((where[keys[i]], i) for _, i in want if keys[i] in where)
            lines = self.journals[name].iter_lines(np.asarray([ln for ln, _ in pairs], np.int64), len(pairs) or 1)
            for (_, i), rec in zip(pairs, itertools.chain.from_iterable(lines)):
                out[i] = rec
        return out


class RunRows:
    """The run as the mix reads it (`core.stream`): per dataset its journal lines in order (parsed only where a
    sample may come from), 02's rebuilt lines and 03's verdicts by key, any record's sample again by key (by seek)."""

    def __init__(self, run_dir: Path, names: list[str], error: type[RunFileError]) -> None:
        self.journals = {n: index_journal(run_dir, n, error) for n in names}
        self.records, self.rebuilt = Records(self.journals), index_rebuilt(run_dir, names, error)
        v = read_verdicts(run_dir, error)  # kept: the small facts the rule reads, not the whole lines
        self.verdicts = None if v is None else {k: {"failed": x["failed"], "truncated": x.get("truncated")}
                                                for k, x in v.items()}

    def lines(self, name: str, chunk: int) -> Iterator[tuple[SampleKey, Any, bool, bool, dict[str, Any] | None]]:
        """(key, finish reason, is the key's record, is a real duplicate, the line or None) per line, in order."""
        idx = self.journals[name]
        need = idx.is_record & ~idx.duplicate & np.fromiter((f not in ("error", "abort") for f in idx.finish), bool,
                                                            len(idx))
        parsed = itertools.chain.from_iterable(idx.iter_lines(np.flatnonzero(need), chunk))
        for i, k in enumerate(idx.keys):
            yield k, idx.finish[i], bool(idx.is_record[i]), bool(idx.duplicate[i]), next(parsed) if need[i] else None

    def resolve(self, rec: dict[str, Any], keep_record: bool = False) -> tuple[Sample | None, dict[str, Any] | None]:
        """`reader.resolve`, reading 02's line once (it also gives the proof level): (sample, rebuilt line)."""
        key = SampleKey.of(rec)
        r = self.rebuilt.get(key) if rec.get("prompt_ids") is None or rec.get("output_ids") is None else None
        return resolve(rec, {key: r} if r is not None else {}, keep_record=keep_record), r

    def load(self, keys: list[SampleKey], keep_record: bool = False) -> list[Sample]:
        """The samples of these keys, in this order."""
        return [self.resolve(r, keep_record)[0] for r in self.records(keys)]  # type: ignore[arg-type,misc]


def last_turns(cands: list[Entry], drop: Any) -> list[Entry]:
    """`hidden.train_turns: last`: per conversation, its highest remaining turn; the others `earlier_turn`."""
    last: dict[str, int] = {}
    for e in cands:
        if e.conv is not None:
            last[e.conv[0]] = max(e.conv[1], last.get(e.conv[0], e.conv[1]))
    out = []
    for e in cands:
        if e.conv is not None and e.conv[1] < last[e.conv[0]]:
            drop(e, "earlier_turn", last_turn=last[e.conv[0]])
            continue
        out.append(e)
    return out


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def turn_figures(items: list[Any], conv: Callable[[Any], tuple[str, int] | None],
                 ids_of: Callable[[list[Any]], list[list[int]]], chunk: int) -> dict[str, int]:
    """What per-turn sequences cost in the mix: a turn's sequence starts with (most of) the earlier turns'.

    Over the turn samples among `items` (`conv(x)`: (conversation, turn) or None; `ids_of(xs)`: their
    input_ids, asked for about `chunk` conversations' samples at a time): `turn_samples`, `conversations`,
    `tokens` (all their tokens), `repeated_prefix_tokens` (per turn, the longest prefix it shares with an
    earlier turn's sequence of the same conversation in the mix: positions whose hidden states are stored
    again, identical, since a state depends only on the tokens up to it), and `last_turn_samples` /
    `last_turn_tokens` (each conversation's highest turn in the mix: what `hidden.train_turns: last` keeps,
    before dedupe, caps and weights).
    """
    convs: dict[tuple[str, str], list[tuple[int, Any]]] = {}
    for x in items:
        if (c := conv(x)) is not None:
            convs.setdefault((x.key.dataset, c[0]), []).append((c[1], x))
    groups = [sorted(g, key=lambda t: t[0]) for g in convs.values()]
    tokens = repeated = last_tokens = 0
    for i in range(0, len(groups), max(1, chunk)):
        batch = groups[i:i + max(1, chunk)]
        ids = iter(ids_of([x for g in batch for _, x in g]))
        for g in batch:
            arrays = [np.asarray(next(ids), dtype=np.int64) for _ in g]
            for j, a in enumerate(arrays):
                tokens += len(a)
                repeated += max((_shared_prefix(a, b) for b in arrays[:j]), default=0)
            last_tokens += len(arrays[-1])
    return {"turn_samples": sum(len(g) for g in groups), "conversations": len(groups), "tokens": tokens,
            "repeated_prefix_tokens": repeated, "last_turn_samples": len(groups), "last_turn_tokens": last_tokens}
