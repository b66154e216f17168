"""The run read as a stream: a journal's small per-line facts held, its records read back in chunks.

`reader.read_run` holds every journal line (ids and texts) in memory: right for 06's few hundred
rows, not for the seeds' 88,000 records of ~2,400 tokens each (13 GiB in 02, 19.8 GiB in 03 at
213M tokens). Here a journal is read once, line by line, into an index of what every stage after
01 needs to see of every line (its byte span, key, finish reason; the supersede rule's verdict on
it), and the lines themselves are parsed again only when a chunk of them is wanted:

- `index_journal(run_dir, name)`: one pass, memory O(lines) of small facts; the same lines, bad
  lines and torn tail as `records.scan_journal` (both read through `records.JournalLines`), the same supersede
  rule (`reader.supersede_codes`).
- `JournalIndex.iter_records(chunk)`: the records (the latest line per key) in journal order, a list
  of at most `chunk` parsed lines at a time, read sequentially.
- `JournalIndex.record(key)` / `line(i)`: one line by seek (05's rows in mix order).
- `index_rebuilt(run_dir, datasets)`: 02's `reconstruct/<dataset>.jsonl` by key, read on demand;
  a mapping (`key in idx`, `idx[key]`), so `reader.resolve` takes it as it takes `read_rebuilt`'s dict.

`read_run` stays the in-memory view of small runs; both apply one rule to one file, and
tests/test_stream.py checks that they agree line for line.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import orjson

from eagle3data.core.reader import COMPLETED, RunFileError, SampleKey, supersede_codes
from eagle3data.core.records import JournalLines



def _lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line with its newline) of each line of a file, read in blocks."""
    off = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            yield lineno, off, line
            off += len(line)


@dataclass
class JournalIndex:
    """One dataset's journal as per-line facts: byte span, key, finish reason, the supersede rule's verdict."""

    name: str
    path: Path
    starts: np.ndarray  # int64 byte offset of each valid line (the lines scan_journal keeps, in order)
    ends: np.ndarray
    keys: list[SampleKey]
    finish: list[Any]
    is_record: np.ndarray  # bool per line: the key's record (its latest completed line, else its latest)
    duplicate: np.ndarray  # bool per line: a record whose key completed twice
    bad_lines: list[str] = field(default_factory=list)
    torn_tail_bytes: int = 0
    _where: dict[SampleKey, int] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def n_records(self) -> int:
        return int(self.is_record.sum())

    def record_lines(self) -> np.ndarray:
        """Indices (into this index's lines) of the records, in journal order."""
        return np.flatnonzero(self.is_record)

    def record_keys(self) -> list[SampleKey]:
        return [self.keys[i] for i in self.record_lines()]

    def line(self, i: int) -> dict[str, Any]:
        """Line `i` parsed (one seek and read)."""
        with open(self.path, "rb") as f:
            return self._read(f, int(i))

    def _read(self, f: Any, i: int) -> dict[str, Any]:
        f.seek(int(self.starts[i]))
        return orjson.loads(f.read(int(self.ends[i] - self.starts[i])))

    def record(self, key: SampleKey) -> dict[str, Any] | None:
        """The record of `key` (None when the journal has no line of it)."""
        if self._where is None:
            self._where = {self.keys[i]: int(i) for i in self.record_lines()}
        i = self._where.get(key)
        return None if i is None else self.line(i)

    def iter_lines(self, which: np.ndarray, chunk: int = 256) -> Iterator[list[dict[str, Any]]]:
        """The lines `which` (sorted indices), parsed, in lists of at most `chunk`, reading the file forward."""
        chunk = max(1, int(chunk))
        if not len(which):
            return
        with open(self.path, "rb") as f:
            buf: list[dict[str, Any]] = []
            for i in which:
                buf.append(self._read(f, int(i)))
                if len(buf) >= chunk:
                    yield buf
                    buf = []
            if buf:
                yield buf

    def iter_records(self, chunk: int = 256, *, completed: bool = False) -> Iterator[list[dict[str, Any]]]:
        """The records in journal order, `chunk` at a time (`completed`: only stop/length ones)."""
        which = self.is_record
        if completed:
            which = which & np.fromiter((fr in COMPLETED for fr in self.finish), bool, len(self.finish))
        return self.iter_lines(np.flatnonzero(which), chunk)


def index_journal(run_dir: str | Path, name: str, error: type[RunFileError] = RunFileError) -> JournalIndex:
    """Index `records/<name>.jsonl` in one pass (an empty index when the journal is absent).

    The lines kept are `records.JournalLines`' (the rule `scan_journal` reads by too: JSON objects with
    dataset, sample_id and finish_reason, ended by their newline); the others are `bad_lines`, a last
    line without its newline is the torn tail. A record of another dataset raises `error` naming the file.
    """
    path = Path(run_dir) / "records" / f"{name}.jsonl"
    starts: list[int] = []
    ends: list[int] = []
    keys: list[SampleKey] = []
    finish: list[Any] = []
    lines = JournalLines(path)
    for _lineno, off, line, obj in lines:
        if str(obj["dataset"]) != name:
            raise error(f"{path}: record {obj['sample_id']!r} has dataset {obj['dataset']!r}, not {name!r}",
                        path=path, fields=("dataset",))
        starts.append(off)
        ends.append(off + len(line))
        keys.append(SampleKey.of(obj))
        finish.append(obj.get("finish_reason"))
    bad, torn = lines.bad_lines, lines.torn_tail_bytes
    first: dict[SampleKey, int] = {}
    codes = np.fromiter((first.setdefault(k, len(first)) for k in keys), np.int64, len(keys))
    is_record, dup = supersede_codes(codes, np.fromiter((fr in COMPLETED for fr in finish), bool, len(finish)))
    return JournalIndex(name, path, np.asarray(starts, np.int64), np.asarray(ends, np.int64), keys, finish,
                        is_record, dup, bad, torn)


class RebuiltIndex(Mapping):
    """02's rebuilt lines by key, each parsed when asked for: `key in idx`, `idx[key]`, `idx.get(key)`.

    Checks each line as `reader.read_rebuilt` does (fields, lists, equal lengths) when it is read."""

    def __init__(self, spans: dict[SampleKey, tuple[Path, int, int, int]], error: type[RunFileError]) -> None:
        self._spans, self._error = spans, error

    def __getitem__(self, key: SampleKey) -> dict[str, Any]:
        path, lineno, start, end = self._spans[key]
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        return checked_rebuilt(orjson.loads(data), path, lineno, self._error)

    def __contains__(self, key: object) -> bool:
        return key in self._spans

    def __iter__(self) -> Iterator[SampleKey]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


def checked_rebuilt(r: Any, path: Path, lineno: int, error: type[RunFileError]) -> dict[str, Any]:
    """A rebuilt line (02's `reconstruct/<dataset>.jsonl`) as the stages take it: its key fields, `input_ids` and
    `loss_mask` as lists of one length; else `error` naming the file, line and field. The one rule for 03's and
    04's readers of 02's lines."""
    missing = [f for f in ("dataset", "sample_id", "input_ids", "loss_mask") if f not in r]
    if missing:
        raise error(f"{path}:{lineno}: missing field(s) {', '.join(missing)}", path=path, line=lineno,
                    fields=tuple(missing))
    ids, mask = r["input_ids"], r["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise error(f"{path}:{lineno}: field `input_ids`/`loss_mask` must be lists", path=path, line=lineno,
                    fields=("input_ids", "loss_mask"))
    if len(ids) != len(mask):
        raise error(f"{path}:{lineno}: field `loss_mask` has {len(mask)} entries for {len(ids)} input_ids",
                    path=path, line=lineno, fields=("loss_mask",))
    return r


def index_rebuilt(run_dir: str | Path, datasets: Iterable[str] | None = None,
                  error: type[RunFileError] = RunFileError) -> RebuiltIndex:
    """Index 02's `reconstruct/<dataset>.jsonl` (all files when datasets is None) by key, one pass per file:
    a line that is not JSON or lacks a key raises `error` with file:line now; its ids are checked when read."""
    folder = Path(run_dir) / "reconstruct"
    if datasets is None:
        paths = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    else:
        paths = [p for p in (folder / f"{d}.jsonl" for d in datasets) if p.exists()]
    spans: dict[SampleKey, tuple[Path, int, int, int]] = {}
    for path in paths:
        for lineno, off, line in _lines(path):
            if not line.strip():
                continue
            try:
                r = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                torn = not line.endswith(b"\n")
                hint = "; the line is cut off (no newline at the end): was the writer stopped?" if torn else ""
                raise error(f"{path}:{lineno}: not JSON ({e}){hint}", path=path, line=lineno) from None
            checked_rebuilt(r, path, lineno, error)
            spans[SampleKey.of(r)] = (path, lineno, off, off + len(line))
    return RebuiltIndex(spans, error)
