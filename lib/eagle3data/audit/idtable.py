"""Records as flat id arrays: the `IdTable` and the audit's fast reader of journals into one.

A journal line is mostly its two id lists. Materialising them as Python ints is what makes
`json.loads` (and orjson) slow, so the fast reader cuts each top-level id list out of the
line, parses the rest with orjson and all the cut list texts at once with numpy. Whatever
it cannot prove it read exactly goes through orjson as a whole line, the reference reader.
`read_journal` reads one JSONL journal (or a .parquet file) into an `IdTable`; the run's
tables joined, 02's rebuilt ids merged in and one record per key kept are `runtable`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import orjson
import pandas as pd

from eagle3data.core.errors import UserInputError
from eagle3data.core.records import record_object


class AuditInputError(UserInputError, ValueError):
    """Audit input cannot be read; the message names the file, line and field."""


META_COLUMNS = ["dataset", "sample_id", "source", "provider", "finish_reason", "ids_exact", "profile", "model", "turn"]


class RecordLengths:
    """A table of records by its offsets: how many records (its `meta` rows) and each one's output and prompt
    length in ids. `IdTable` (ids held) and `streamed.RecordFacts` (ids let go) both read their lengths so."""

    meta: pd.DataFrame
    prompt_off: np.ndarray
    output_off: np.ndarray

    def __len__(self) -> int:
        return len(self.meta)

    @property
    def output_len(self) -> np.ndarray:
        return np.diff(self.output_off)

    @property
    def prompt_len(self) -> np.ndarray:
        return np.diff(self.prompt_off)


@dataclass
class IdTable(RecordLengths):
    """Records as flat id arrays with offsets, plus per-record metadata.

    `output[output_off[i]:output_off[i+1]]` are record i's output ids; `has_output[i]` is
    False where the record had none (null). `messages`, `tools`, `reasoning`, `content` are
    per-record Python lists, present only when read with `source_fields=True`.
    """

    meta: pd.DataFrame
    prompt: np.ndarray
    prompt_off: np.ndarray
    has_prompt: np.ndarray
    output: np.ndarray
    output_off: np.ndarray
    has_output: np.ndarray
    messages: list | None = None
    tools: list | None = None
    reasoning: list | None = None
    content: list | None = None
    loss_mask: list | None = None
    tool_calls: list | None = None
    bad_lines: list[str] = field(default_factory=list)
    torn_tail_bytes: int = 0

    def output_ids(self, i: int) -> np.ndarray:
        return self.output[self.output_off[i] : self.output_off[i + 1]]

    def prompt_ids(self, i: int) -> np.ndarray:
        return self.prompt[self.prompt_off[i] : self.prompt_off[i + 1]]

    @property
    def n_tokens(self) -> int:
        return int(len(self.output) + len(self.prompt))


def _flat(lists: Sequence[Any], where: Callable[[int], str], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Python lists of ids (or None) -> flat int64 array, offsets, presence mask."""
    has = np.fromiter((x is not None for x in lists), dtype=bool, count=len(lists))
    lens = np.fromiter((len(x) if x is not None else 0 for x in lists), dtype=np.int64, count=len(lists))
    off = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    for i, x in enumerate(lists):  # fromiter alone would truncate 1.5 to 1 and take true as 1
        if x is not None and (not isinstance(x, list) or not all(type(t) is int for t in x)):
            raise AuditInputError(f"{where(i)}: field `{name}` must be a list of integer ids or null")
    try:
        flat = np.fromiter(chain.from_iterable(x for x in lists if x), dtype=np.int64, count=int(off[-1]))
    except OverflowError:
        i = next(i for i, x in enumerate(lists) if x and not all(-2**63 <= t < 2**63 for t in x))
        raise AuditInputError(f"{where(i)}: field `{name}` holds an id beyond 64-bit integers") from None
    return flat, off, has


def _table_from_dicts(objs: list[dict[str, Any]], where: Callable[[int], str], source_fields: bool) -> IdTable:
    for i, o in enumerate(objs):
        for k in ("prompt_ids", "output_ids"):
            v = o.get(k)
            if v is not None and not isinstance(v, list):
                raise AuditInputError(f"{where(i)}: field `{k}` must be a list of integer ids or null")
    prompt = _flat([o.get("prompt_ids") for o in objs], where, "prompt_ids")
    output = _flat([o.get("output_ids") for o in objs], where, "output_ids")
    return _assemble_table(objs, prompt, output, source_fields)


def _assemble_table(objs: list[dict[str, Any]], prompt: tuple[np.ndarray, np.ndarray, np.ndarray],
                    output: tuple[np.ndarray, np.ndarray, np.ndarray], source_fields: bool) -> IdTable:
    """An IdTable from parsed records and their flat (ids, offsets, present) prompt/output arrays."""
    meta = pd.DataFrame({c: [o.get(c) for o in objs] for c in META_COLUMNS})
    meta["billed_prompt_tokens"] = [u.get("prompt_tokens") if isinstance(u := o.get("usage"), dict) else None
                                    for o in objs]
    t = IdTable(meta, *prompt, *output)
    if source_fields:
        t.messages = [o.get("messages") for o in objs]
        t.tools = [o.get("tools") for o in objs]
        t.reasoning = [o.get("reasoning") for o in objs]
        t.content = [o.get("content") for o in objs]
        t.loss_mask = [o.get("loss_mask") for o in objs]
        t.tool_calls = [o.get("tool_calls") for o in objs]
    return t


def _split_torn(data: bytes) -> tuple[bytes, int]:
    end = data.rfind(b"\n") + 1
    return data[:end], len(data) - end


def _read_orjson(path: Path, data: bytes, source_fields: bool, first_line: int = 0) -> IdTable:
    objs, lines, bad = [], [], []
    for lineno, line in enumerate(data.splitlines(), start=first_line + 1):
        if not line.strip():
            continue
        obj, why = record_object(line, f"{path}:{lineno}")
        if obj is None:
            bad.append(why)
            continue
        objs.append(obj)
        lines.append(lineno)
    t = _table_from_dicts(objs, lambda i: f"{path}:{lines[i]}", source_fields)
    t.meta["line"] = lines
    t.bad_lines = bad
    return t


# --------------------------------------------------------------------------- fast JSONL reader
#
# A journal line is mostly its two id lists. Materialising them as Python ints is what makes
# `json.loads` (and orjson) slow, so the fast reader cuts each top-level `"prompt_ids":[...]` /
# `"output_ids":[...]` out of the line, parses the rest of the line with orjson (metadata and
# text fields) and all the cut list texts of the file at once with numpy. Whatever it cannot
# prove it read exactly goes through orjson as a whole line, which is the reference reader.

_ID_KEYS = ("prompt_ids", "output_ids")
_ID_PATTERNS = tuple(b'"' + k.encode() + b'":[' for k in _ID_KEYS)
_LUT_MAX = 1 << 22


@dataclass
class _Cuts:
    """The id lists of one key cut out of the lines: per cut record its index and list text."""

    rec: list[int] = field(default_factory=list)
    text: list[bytes] = field(default_factory=list)


def _printed_width(vals: np.ndarray) -> np.ndarray:
    """Digits of each non-negative value; 0 from 10**18 up, where fromstring may saturate."""
    if len(vals) == 0:
        return np.zeros(0, np.int8)
    hi = int(vals.max())
    if hi < _LUT_MAX:
        width = np.ones(hi + 1, np.int8)
        k = 10
        while k <= hi:
            width[k:] += 1
            k *= 10
        return width[vals]
    width = np.ones(len(vals), np.int8)
    k = 10
    while k < 10**18:
        width += vals >= k
        k *= 10
    width[vals >= 10**18] = 0
    return width


def _parse_cuts(cuts: _Cuts, redo: set[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(record index, value count, flat values) of the cut lists; records whose text is not exact go to `redo`.

    Only lists written with digits and commas alone are taken (a sign, space or anything else
    goes to orjson). numpy's text parser reads each; each value takes at least its printed
    width and each comma a byte, so widths plus commas add up to the text's length only when
    every value was written canonically (no leading zero, empty or trailing element, no
    saturated overflow): then the parse read every byte as orjson would have.
    """
    m = len(cuts.rec)
    rec = np.asarray(cuts.rec, dtype=np.int64)
    counts = np.zeros(m, np.int64)
    tlen = np.zeros(m, np.int64)
    parts, unread = [], []
    for j, text in enumerate(cuts.text):
        if len(text):
            if text.translate(None, b"0123456789,"):  # a sign, space or anything else: orjson decides
                unread.append(j)
                continue
            try:
                v = np.fromstring(text, dtype=np.int64, sep=",")  # text mode: not deprecated
            except ValueError:
                unread.append(j)
                continue
            parts.append(v)
            counts[j] = len(v)
            tlen[j] = len(text)
    vals = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    rows = np.flatnonzero(counts)
    ok = counts == 0
    if len(rows):
        width = _printed_width(vals)
        # each value takes at least its width and each comma a byte, so equal totals mean
        # equality for every list; only when they differ is it worth finding which
        if int(width.sum(dtype=np.int64)) + int(counts.sum()) - len(rows) == int(tlen[rows].sum()):
            ok[rows] = True
        else:
            start = np.zeros(len(rows) + 1, np.int64)
            np.cumsum(counts[rows], out=start[1:])
            ws = np.array([width[a:b].sum(dtype=np.int64) for a, b in zip(start[:-1], start[1:])], np.int64)
            ok[rows] = ws + counts[rows] - 1 == tlen[rows]
    ok &= (counts > 0) | (tlen == 0)
    ok[unread] = False
    if not ok.all():
        redo.update(rec[~ok].tolist())
        vals = vals[np.repeat(ok, counts)]
        counts[~ok] = 0
    return rec, counts, vals


def _flat_ids(n: int, parsed: tuple[np.ndarray, np.ndarray, np.ndarray], other: dict[int, Any], drop: set[int],
              where: Callable[[int], str], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat ids, offsets and presence for n records from cut lists (`parsed`) and orjson values (`other`)."""
    rec, counts, vals = parsed
    if drop or other:
        gone = np.isin(rec, np.fromiter(drop | set(other), np.int64, count=len(drop | set(other))))
        if gone.any():
            vals = vals[~np.repeat(gone, counts)]
            rec, counts = rec[~gone], counts[~gone]
    has = np.zeros(n, bool)
    lens = np.zeros(n, np.int64)
    has[rec] = True
    lens[rec] = counts
    lists: dict[int, list] = {}
    for i, v in other.items():
        if v is None:
            continue
        if not isinstance(v, list) or not all(type(t) is int for t in v):
            raise AuditInputError(f"{where(i)}: field `{name}` must be a list of integer ids or null")
        has[i] = True
        lens[i] = len(v)
        if v:
            lists[i] = v
    off = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    if not lists:
        return vals, off, has
    flat = np.empty(int(off[-1]), np.int64)
    src = np.zeros(len(rec) + 1, np.int64)
    np.cumsum(counts, out=src[1:])
    for k, i in enumerate(rec.tolist()):
        flat[off[i] : off[i + 1]] = vals[src[k] : src[k + 1]]
    for i, v in lists.items():
        try:
            flat[off[i] : off[i + 1]] = v
        except OverflowError:
            raise AuditInputError(f"{where(i)}: field `{name}` holds an id beyond 64-bit integers") from None
    return flat, off, has


def _read_fast(path: Path, data: bytes, source_fields: bool, first_line: int = 0) -> IdTable:
    """JSONL -> IdTable: id lists parsed as text by numpy, the rest of each line by orjson (see above); lines
    numbered from `first_line` + 1 (`data` may be a run of whole lines from inside a journal)."""
    mv = memoryview(data)
    objs: list[dict | None] = []
    linenos: list[int] = []
    spans: list[tuple[int, int]] = []
    bad: list[tuple[int, str]] = []
    cuts = [_Cuts() for _ in _ID_KEYS]
    # the string that stands in for a cut list while orjson reads the rest of the line; fresh
    # per read, so no file can hold it: a line is taken from the cut reading only when the
    # top-level key resolves to it (not a nested or duplicate key of the same name)
    nonce = secrets.token_hex(8)
    hole, hole_json = "\x00" + nonce, b'"\\u0000' + nonce.encode() + b'"'
    pos, lineno, size = 0, first_line, len(data)
    while pos < size:
        end = data.find(b"\n", pos)
        end = size if end < 0 else end
        start, pos = pos, end + 1
        lineno += 1
        if data[start] != 0x7B and not data[start:end].strip():  # 0x7B: "{"
            continue
        holes = []
        for k, pat in enumerate(_ID_PATTERNS):
            i = data.find(pat, start, end)
            j = data.find(b"]", i + len(pat), end) if i >= 0 else -1
            if j >= 0:
                holes.append((i + len(pat) - 1, j + 1, k))
        holes.sort()
        if len(holes) == 2 and holes[0][1] > holes[1][0]:
            holes = []
        obj = None
        if holes:
            pieces, at = [], start
            for a, b, _ in holes:
                pieces += [mv[at:a], hole_json]
                at = b
            pieces.append(mv[at:end])
            try:
                obj = orjson.loads(b"".join(pieces))
            except orjson.JSONDecodeError:
                obj = None
            if not (isinstance(obj, dict) and all(obj.get(_ID_KEYS[k]) == hole for *_, k in holes)
                    and all(k in obj for k in ("dataset", "sample_id", "finish_reason"))):
                obj = None
        if obj is None:
            holes = []
            obj, why = record_object(mv[start:end], f"{path}:{lineno}")
            if obj is None:
                bad.append((lineno, why))
                continue
        for a, b, k in holes:
            cuts[k].rec.append(len(objs))
            cuts[k].text.append(data[a + 1 : b - 1])
        objs.append(obj)
        linenos.append(lineno)
        spans.append((start, end))

    redo: set[int] = set()
    parsed = [_parse_cuts(c, redo) for c in cuts]
    drop: set[int] = set()
    for r in sorted(redo):  # a list text numpy would not vouch for: orjson reads the whole line
        s, e = spans[r]
        obj, why = record_object(mv[s:e], f"{path}:{linenos[r]}")
        if obj is None:
            bad.append((linenos[r], why))
            drop.add(r)
        else:
            objs[r] = obj
    keep = [i for i in range(len(objs)) if i not in drop]
    where = lambda i: f"{path}:{linenos[i]}"  # noqa: E731
    n = len(objs)
    flats = []
    for k, key in enumerate(_ID_KEYS):
        cut_here = set(cuts[k].rec)
        other = {i: o.get(key) for i, o in enumerate(objs) if i not in drop and (i not in cut_here or i in redo)}
        flats.append(_flat_ids(n, parsed[k], other, drop, where, key))
    if drop:  # a line that failed only inside its id list: it leaves the table, as a bad line
        idx = np.asarray(keep, np.int64)
        flats = [take_rows(*f, idx) for f in flats]
        objs = [objs[i] for i in keep]
        linenos = [linenos[i] for i in keep]
    t = _assemble_table(objs, flats[0], flats[1], source_fields)
    t.meta["line"] = linenos
    t.bad_lines = [why for _, why in sorted(bad)]
    return t


def take_rows(flat: np.ndarray, off: np.ndarray, has: np.ndarray, rows: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The records `rows` of a flat id array with offsets."""
    lens = np.diff(off)[rows]
    new = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lens, out=new[1:])
    parts = [flat[off[i] : off[i + 1]] for i in rows.tolist()]
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), new, has[rows]


def _list_column(col: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    off = np.asarray(arr.offsets, dtype=np.int64)
    off = off - off[0]
    vals = np.asarray(arr.flatten().to_numpy(zero_copy_only=False))
    has = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    return vals, off, has


def _struct_field(tab: Any, column: str, field: str) -> list[Any]:
    """`column.field` per row of an arrow table (None where the column, the field or the value is absent)."""
    import pyarrow as pa

    if column not in tab.column_names:
        return [None] * tab.num_rows
    col = tab.column(column)
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not pa.types.is_struct(arr.type) or arr.type.get_field_index(field) < 0:
        return [None] * tab.num_rows
    values = arr.field(field).to_pylist()
    valid = arr.is_valid().to_pylist()
    return [v if ok else None for v, ok in zip(values, valid)]


def _table_from_arrow(tab: Any) -> IdTable:
    meta = pd.DataFrame({c: tab.column(c).to_pylist() if c in tab.column_names else [None] * tab.num_rows
                         for c in META_COLUMNS})
    meta["billed_prompt_tokens"] = _struct_field(tab, "usage", "prompt_tokens")
    meta["line"] = np.arange(1, len(meta) + 1)
    if meta["dataset"].isna().any() or meta["sample_id"].isna().any() or meta["finish_reason"].isna().any():
        raise ValueError("missing key fields")
    prompt, poff, hasp = _list_column(tab.column("prompt_ids"))
    output, ooff, haso = _list_column(tab.column("output_ids"))
    return IdTable(meta, prompt, poff, hasp, output, ooff, haso)


def read_journal(path: str | Path, *, source_fields: bool = False) -> IdTable:
    """Read one records journal (JSONL) or columnar file (.parquet) into an IdTable.

    JSONL: the id lists are parsed as text by numpy, the rest of each line by orjson; any
    line the fast path cannot vouch for is read whole by orjson (which names each bad line).
    A torn last line is ignored.
    `source_fields=True` also keeps messages, tools and the text fields (tokenizer checks).
    """
    path = Path(path)
    if not path.exists():
        raise AuditInputError(f"{path}: no such file")
    if path.suffix == ".parquet":
        return next(parquet_tables(path, source_fields=source_fields))
    data, torn = _split_torn(path.read_bytes())
    t = read_lines(path, data, source_fields=source_fields)
    t.torn_tail_bytes = torn
    return t


def read_lines(path: str | Path, data: bytes, *, first_line: int = 0, source_fields: bool = True) -> IdTable:
    """Whole lines of the journal `path` (all of it, or a run of its lines from line `first_line` + 1 on) as an
    IdTable: the fast reader, or the line reader where a lone carriage return splits lines (its numbering kept)."""
    path = Path(path)
    t = (_read_orjson if b"\r" in data else _read_fast)(path, data, source_fields, first_line)
    t.meta["file"] = str(path)
    return t


def parquet_tables(path: Path, rows: int | None = None, *, source_fields: bool = True) -> Iterator[IdTable]:
    """A columnar file (.parquet) as IdTables: the whole file (`rows` None: `pq.read_table`), or its record batches of
    at most `rows` rows (`ParquetFile.iter_batches`: memory set by the batch and the file's row group); rows
    numbered from 1 across them (`line`), a bad field named by its row; a file without rows is one empty table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = 0

    def table(tab: Any) -> IdTable:
        if source_fields:
            objs = tab.to_pylist()
            for o in objs:
                for k in ("messages", "tools"):
                    if isinstance(o.get(k), str):  # JSON text columns
                        o[k] = orjson.loads(o[k])
            t = _table_from_dicts(objs, lambda i: f"{path}:row {first + i}", True)
        else:
            if "prompt_ids" not in tab.column_names:
                tab = tab.append_column("prompt_ids", pa.nulls(tab.num_rows, pa.list_(pa.int64())))
            t = _table_from_arrow(tab)
        t.meta["line"] = np.arange(first + 1, first + len(t) + 1)
        t.meta["file"] = str(path)
        return t

    def columns(names: list[str]) -> None:
        for k in ("dataset", "sample_id", "finish_reason", "output_ids"):
            if k not in names:
                raise AuditInputError(f"{path}: missing column `{k}`")

    try:
        if rows is None:
            tab = pq.read_table(path)
            columns(tab.column_names)
            yield table(tab)
            return
        f = pq.ParquetFile(path)
        columns(f.schema_arrow.names)
        for batch in f.iter_batches(batch_size=rows):
            if batch.num_rows:
                yield table(pa.Table.from_batches([batch]))
                first += batch.num_rows
        if not first:
            yield table(f.schema_arrow.empty_table())
    except (pa.ArrowInvalid, OSError) as e:
        raise AuditInputError(f"{path}: not a readable parquet file ({e})") from None
