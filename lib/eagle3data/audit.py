"""Stage 03: a vectorized structural audit of every record, with honest numbers.

Records are held as flat id arrays plus offsets (`IdTable`). The id checks find every
special token of the profile in one pass over the flat output array and reason on their
positions, so there is no Python loop per record; only the optional tokenizer checks
(re-templating, decode->encode roundtrip, decoded text against the record's text fields)
loop. Every check has a stable name (`CHECKS`); a record's verdict lists the names of the
checks it failed. `finish_reason: length` is reported as truncated, never as broken.

Statuses per record and check: pass, fail, n/a (the check does not apply to this record or
profile) and not run (the check needs a tokenizer that was not given).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import orjson
import pandas as pd

from .profiles import Profile, get_profile

PASS, FAIL, NA, NOT_RUN = 0, 1, 2, 3
STATUS_NAMES = {PASS: "pass", FAIL: "fail", NA: "n/a", NOT_RUN: "not run"}
TARGET_RATE = 0.001  # the failure rate the "records needed" column bounds (0.1 %)


class AuditInputError(ValueError):
    """Audit input cannot be read; the message names the file, line and field."""


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    """One audit check: a stable name, what it asserts, and when it applies."""

    name: str
    what: str
    applies: Callable[[Profile], bool] = lambda p: True
    needs_tokenizer: bool = False


def _reasoning(p: Profile) -> bool:
    return p.is_reasoning


def _tools(p: Profile) -> bool:
    return p.tool_calls is not None


def _reasoning_tools(p: Profile) -> bool:
    return p.is_reasoning and p.tool_calls is not None


_CHECK_LIST = [
    Check("record.complete", "finish_reason is stop or length (not error/abort)"),
    Check("record.has_ids", "prompt and output ids exist (journal, or 02_reconstruct for API records)"),
    Check("output.ends_with_eot", "output ends with end-of-turn (the guard token may follow it)"),
    Check("output.single_eot", "exactly one end-of-turn in the output (none when truncated)"),
    Check("output.single_reasoning_close", "exactly one reasoning-close (at most one when truncated)", _reasoning),
    Check("output.close_before_eot", "reasoning-close comes before end-of-turn", _reasoning),
    Check("output.no_reasoning_open", "no reasoning-open inside the output", _reasoning),
    Check("output.reasoning_nonempty", "at least one reasoning token before reasoning-close", _reasoning),
    Check("output.answer_nonempty", "at least one token between reasoning-close (or start) and end-of-turn"),
    Check("output.tool_calls_balanced", "tool-call tokens balanced, in order, before end-of-turn", _tools),
    Check("output.tool_calls_outside_reasoning", "no tool-call token before reasoning-close", _reasoning_tools),
    Check("output.ids_in_vocab", "every output id is in [0, vocab_size)"),
    Check("prompt.ids_in_vocab", "every prompt id is in [0, vocab_size)"),
    Check("prompt.generation_prompt", "prompt ends with the generation prompt the profile expects"),
    Check("prompt.tools_present", "every tool of the source is named in the decoded prompt", needs_tokenizer=True),
    Check("prompt.system_present", "the source's system prompt is in the decoded prompt", needs_tokenizer=True),
    Check("prompt.retemplate", "prompt ids equal re-templating the source messages", needs_tokenizer=True),
    Check("text.roundtrip", "encode(decode(output ids)) gives the same ids", needs_tokenizer=True),
    Check("text.fields_match", "decoded reasoning/answer spans equal the record's reasoning/content",
          needs_tokenizer=True),
    Check("dataset.unique_sample_id", "no other record of the dataset has this sample_id (earlier line wins)"),
    Check("dataset.distinct_outputs", "no record with a different prompt has identical output ids"),
]
CHECKS: dict[str, Check] = {c.name: c for c in _CHECK_LIST}
CHECK_NAMES: list[str] = [c.name for c in _CHECK_LIST]


# --------------------------------------------------------------------------- records as arrays


META_COLUMNS = ["dataset", "sample_id", "source", "provider", "finish_reason", "ids_exact"]


@dataclass
class IdTable:
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
    bad_lines: list[str] = field(default_factory=list)
    torn_tail_bytes: int = 0

    def __len__(self) -> int:
        return len(self.meta)

    @property
    def output_len(self) -> np.ndarray:
        return np.diff(self.output_off)

    @property
    def prompt_len(self) -> np.ndarray:
        return np.diff(self.prompt_off)

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
    t = IdTable(meta, *prompt, *output)
    if source_fields:
        t.messages = [o.get("messages") for o in objs]
        t.tools = [o.get("tools") for o in objs]
        t.reasoning = [o.get("reasoning") for o in objs]
        t.content = [o.get("content") for o in objs]
        t.loss_mask = [o.get("loss_mask") for o in objs]
    return t


def _split_torn(data: bytes) -> tuple[bytes, int]:
    end = data.rfind(b"\n") + 1
    return data[:end], len(data) - end


def _read_orjson(path: Path, data: bytes, source_fields: bool) -> IdTable:
    objs, lines, bad = [], [], []
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            bad.append(f"{path}:{lineno}: not JSON ({e})")
            continue
        if not isinstance(obj, dict):
            bad.append(f"{path}:{lineno}: line is not a JSON object")
            continue
        missing = [k for k in ("dataset", "sample_id", "finish_reason") if k not in obj]
        if missing:
            bad.append(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
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


def _line_object(text: bytes | memoryview, where: str) -> tuple[dict | None, str | None]:
    """orjson reading of one whole line: (object, None) or (None, why the line is bad)."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        return None, f"{where}: not JSON ({e})"
    if not isinstance(obj, dict):
        return None, f"{where}: line is not a JSON object"
    missing = [k for k in ("dataset", "sample_id", "finish_reason") if k not in obj]
    if missing:
        return None, f"{where}: missing field(s) {', '.join(missing)}"
    return obj, None


def _read_fast(path: Path, data: bytes, source_fields: bool) -> IdTable:
    """JSONL -> IdTable: id lists parsed as text by numpy, the rest of each line by orjson (see above)."""
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
    pos, lineno, size = 0, 0, len(data)
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
            obj, why = _line_object(mv[start:end], f"{path}:{lineno}")
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
        obj, why = _line_object(mv[s:e], f"{path}:{linenos[r]}")
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
        flats = [_take_rows(*f, idx) for f in flats]
        objs = [objs[i] for i in keep]
        linenos = [linenos[i] for i in keep]
    t = _assemble_table(objs, flats[0], flats[1], source_fields)
    t.meta["line"] = linenos
    t.bad_lines = [why for _, why in sorted(bad)]
    return t


def _take_rows(flat: np.ndarray, off: np.ndarray, has: np.ndarray, rows: np.ndarray
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


def _table_from_arrow(tab: Any) -> IdTable:
    meta = pd.DataFrame({c: tab.column(c).to_pylist() if c in tab.column_names else [None] * tab.num_rows
                         for c in META_COLUMNS})
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
        return _read_parquet(path, source_fields)
    data, torn = _split_torn(path.read_bytes())
    # a lone carriage return splits lines for the line reader; keep its numbering there
    t = _read_orjson(path, data, source_fields) if b"\r" in data else _read_fast(path, data, source_fields)
    t.torn_tail_bytes = torn
    t.meta["file"] = str(path)
    return t


def _read_parquet(path: Path, source_fields: bool) -> IdTable:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        tab = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise AuditInputError(f"{path}: not a readable parquet file ({e})") from None
    for k in ("dataset", "sample_id", "finish_reason", "output_ids"):
        if k not in tab.column_names:
            raise AuditInputError(f"{path}: missing column `{k}`")
    if source_fields:
        objs = tab.to_pylist()
        for o in objs:
            for k in ("messages", "tools"):
                if isinstance(o.get(k), str):  # JSON text columns
                    o[k] = orjson.loads(o[k])
        t = _table_from_dicts(objs, lambda i: f"{path}:row {i}", True)
    else:
        if "prompt_ids" not in tab.column_names:
            tab = tab.append_column("prompt_ids", pa.nulls(tab.num_rows, pa.list_(pa.int64())))
        t = _table_from_arrow(tab)
    t.meta["line"] = np.arange(1, len(t) + 1)
    t.meta["file"] = str(path)
    return t


def concat_tables(tables: Sequence[IdTable]) -> IdTable:
    """One IdTable from several (e.g. one per dataset journal)."""
    tables = [t for t in tables if t is not None]
    if not tables:
        return _empty_table()
    if len(tables) == 1:
        return tables[0]

    def cat(name: str, off_name: str) -> tuple[np.ndarray, np.ndarray]:
        flats = [getattr(t, name).astype(np.int64, copy=False) for t in tables]
        offs, base = [np.zeros(1, np.int64)], 0
        for t in tables:
            o = getattr(t, off_name)
            offs.append(o[1:] + base)
            base += int(o[-1])
        return np.concatenate(flats), np.concatenate(offs)

    prompt, poff = cat("prompt", "prompt_off")
    output, ooff = cat("output", "output_off")
    t = IdTable(pd.concat([t.meta for t in tables], ignore_index=True), prompt, poff,
                np.concatenate([t.has_prompt for t in tables]), output, ooff,
                np.concatenate([t.has_output for t in tables]))
    for f in ("messages", "tools", "reasoning", "content", "loss_mask"):
        if all(getattr(x, f) is not None for x in tables):
            setattr(t, f, list(chain.from_iterable(getattr(x, f) for x in tables)))
    t.bad_lines = list(chain.from_iterable(x.bad_lines for x in tables))
    t.torn_tail_bytes = sum(x.torn_tail_bytes for x in tables)
    return t


def _empty_table() -> IdTable:
    z = np.zeros(1, np.int64)
    return IdTable(pd.DataFrame({c: [] for c in META_COLUMNS + ["line", "file"]}), np.zeros(0, np.int64), z,
                   np.zeros(0, bool), np.zeros(0, np.int64), z.copy(), np.zeros(0, bool))


def merge_reconstruct(table: IdTable, run_dir: str | Path) -> IdTable:
    """Fill ids of API records (output_ids null) from `reconstruct/<dataset>.jsonl` where 02 wrote it.

    Adds the meta column `ids_from`: `journal`, `reconstruct`, or `none`. A missing or
    unreadable reconstruct file leaves the record without ids (check `record.has_ids`).
    """
    meta = table.meta
    meta["ids_from"] = np.where(table.has_output, "journal", "none")
    need = np.flatnonzero(~table.has_output)
    if len(need) == 0:
        return table
    rebuilt: dict[tuple[str, str], dict[str, Any]] = {}
    for ds in meta["dataset"].iloc[need].unique():
        p = Path(run_dir) / "reconstruct" / f"{ds}.jsonl"
        if not p.exists():
            continue
        data, _ = _split_torn(p.read_bytes())
        for line in data.splitlines():
            try:
                o = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(o, dict) and isinstance(o.get("output_ids"), list):
                rebuilt[(str(o.get("dataset", ds)), str(o.get("sample_id")))] = o
    if not rebuilt:
        return table
    outs = [table.output_ids(i) for i in range(len(table))]
    prompts = [table.prompt_ids(i) for i in range(len(table))]
    has_o, has_p = table.has_output.copy(), table.has_prompt.copy()
    for i in need:
        o = rebuilt.get((str(meta.at[i, "dataset"]), str(meta.at[i, "sample_id"])))
        if o is None:
            continue
        outs[i] = np.asarray(o["output_ids"], dtype=np.int64)
        has_o[i] = True
        if isinstance(o.get("prompt_ids"), list):
            prompts[i] = np.asarray(o["prompt_ids"], dtype=np.int64)
            has_p[i] = True
        if table.loss_mask is not None:
            table.loss_mask[i] = o.get("loss_mask")
        meta.at[i, "ids_from"] = "reconstruct"
    for name, off_name, segs in (("output", "output_off", outs), ("prompt", "prompt_off", prompts)):
        lens = np.fromiter((len(s) for s in segs), np.int64, count=len(segs))
        off = np.zeros(len(segs) + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        setattr(table, name, np.concatenate([s.astype(np.int64, copy=False) for s in segs])
                if segs else np.zeros(0, np.int64))
        setattr(table, off_name, off)
    table.has_output, table.has_prompt = has_o, has_p
    return table


def load_run(run_dir: str | Path, *, source_fields: bool = False) -> IdTable:
    """Every journal of a run (`records/*.jsonl`), with 02's rebuilt ids merged in where present."""
    paths = sorted((Path(run_dir) / "records").glob("*.jsonl"))
    t = concat_tables([read_journal(p, source_fields=source_fields) for p in paths])
    return merge_reconstruct(t, run_dir)


# --------------------------------------------------------------------------- vectorized id checks


_CHUNK = 1 << 18  # elements per step of the scans: the temporaries stay in the CPU cache


def _band_scan(ids: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int, int]:
    """One pass over ids: positions of ids in [lo, hi], and the array's min and max (for the vocab check).

    `(id - lo)` read as unsigned is at most `hi - lo` exactly for ids in the band (the
    subtraction wraps the rest out of it), so the band costs one subtraction and one compare.
    """
    if len(ids) == 0:
        return np.zeros(0, np.int64), 0, -1
    if ids.dtype not in (np.int32, np.int64) or not (np.iinfo(ids.dtype).min <= lo <= hi <= np.iinfo(ids.dtype).max):
        ids = ids.astype(np.int64)
    udt = np.uint32 if ids.dtype == np.int32 else np.uint64
    n = min(_CHUNK, len(ids))
    diff, mask = np.empty(n, ids.dtype), np.empty(n, bool)
    hits, lo_all, hi_all = [], None, None
    for s in range(0, len(ids), _CHUNK):
        a = ids[s : s + _CHUNK]
        d, m = diff[: len(a)], mask[: len(a)]
        np.subtract(a, ids.dtype.type(lo), out=d, casting="unsafe")
        np.less_equal(d.view(udt), udt(hi - lo), out=m)
        h = np.flatnonzero(m)
        if len(h):
            hits.append(h + s)
        amin, amax = a.min(), a.max()
        lo_all = amin if lo_all is None else min(lo_all, amin)
        hi_all = amax if hi_all is None else max(hi_all, amax)
    return (np.concatenate(hits) if hits else np.zeros(0, np.int64)), int(lo_all), int(hi_all)


def _events(ids: np.ndarray, off: np.ndarray, codes: dict[int, int]
            ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int, int]:
    """special_events plus the id array's min and max from the same pass."""
    if not codes or len(ids) == 0:
        e = np.zeros(0, np.int64)
        lo_all, hi_all = (int(ids.min()), int(ids.max())) if len(ids) else (0, -1)
        return (e, e.copy(), e.copy()), lo_all, hi_all
    lo, hi = min(codes), max(codes)
    lut = np.zeros(hi - lo + 1, np.int16)
    for tid, c in codes.items():
        lut[tid - lo] = c
    pos, lo_all, hi_all = _band_scan(ids, lo, hi)
    code = lut[ids[pos] - lo].astype(np.int64)
    keep = code > 0
    pos, code = pos[keep], code[keep]
    rec = np.searchsorted(off, pos, side="right") - 1
    return (rec, pos - off[rec], code), lo_all, hi_all


def special_events(ids: np.ndarray, off: np.ndarray, codes: dict[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All occurrences of the given ids in one pass: (record index, position in record, code).

    The flat array is scanned in cache-sized chunks for ids inside the [min, max] band of
    the special ids, then a small lookup table maps each hit to its code (0 = not special).
    """
    return _events(ids, off, codes)[0]


def _out_of_range(ids: np.ndarray, off: np.ndarray, vocab: int, lo_hi: tuple[int, int] | None = None) -> np.ndarray:
    """Per record: any id outside [0, vocab). Whole-array min/max first; the slow path only on a hit."""
    n = len(off) - 1
    bad = np.zeros(n, bool)
    if len(ids) == 0:
        return bad
    lo, hi = lo_hi if lo_hi is not None else (ids.min(), ids.max())
    if lo >= 0 and hi < vocab:
        return bad
    pos = np.flatnonzero((ids < 0) | (ids >= vocab))
    bad[np.unique(np.searchsorted(off, pos, side="right") - 1)] = True
    return bad


@dataclass
class Positions:
    """Per record: where the profile's special tokens sit in the output (-1 = absent)."""

    first_close: np.ndarray
    first_eot: np.ndarray
    n_close: np.ndarray
    n_eot: np.ndarray
    n_open: np.ndarray
    reasoning_start: np.ndarray
    tool_sections: pd.DataFrame  # record, begin, end (positions in the output)
    events: pd.DataFrame  # record, pos, token


def structural_checks(table: IdTable, profile: Profile) -> tuple[dict[str, np.ndarray], Positions]:
    """The id checks on every record at once; returns status arrays per check and positions."""
    n = len(table)
    L = table.output_len
    fr = table.meta["finish_reason"].to_numpy(dtype=object)
    trunc = fr == "length"
    usable = table.has_output & ((fr == "stop") | trunc)
    ids, off = table.output, table.output_off

    names: list[tuple[str, int]] = [("eot", profile.end_of_turn.id)]
    for nm in ("guard", "reasoning_open", "reasoning_close"):
        tok = getattr(profile, nm)
        if tok is not None:
            names.append((nm, tok.id))
    tc = profile.tool_calls
    tool_names: list[str] = []
    if tc is not None:
        for nm in ("section_begin", "call_begin", "argument_begin", "call_end", "section_end"):
            tok = getattr(tc, nm)
            if tok is not None:
                names.append((nm, tok.id))
                tool_names.append(nm)
    code_of = {nm: i + 1 for i, (nm, _) in enumerate(names)}
    K = len(names) + 1
    (rec, rel, code), ids_lo, ids_hi = _events(ids, off, {tid: code_of[nm] for nm, tid in names})

    counts = np.bincount(rec * K + code, minlength=n * K).reshape(n, K) if n else np.zeros((0, K), np.int64)
    first = np.full((n, K), -1, np.int64)
    if len(rec):
        big = np.full((n, K), np.iinfo(np.int64).max, np.int64)
        np.minimum.at(big, (rec, code), rel)
        first = np.where(big == np.iinfo(np.int64).max, -1, big)

    def cnt(nm: str) -> np.ndarray:
        return counts[:, code_of[nm]] if nm in code_of else np.zeros(n, np.int64)

    def fst(nm: str) -> np.ndarray:
        return first[:, code_of[nm]] if nm in code_of else np.full(n, -1, np.int64)

    st: dict[str, np.ndarray] = {}

    def status(fail: np.ndarray, na: np.ndarray | None = None) -> np.ndarray:
        s = np.where(fail, FAIL, PASS).astype(np.int8)
        s[~usable] = NA
        if na is not None:
            s[na] = NA
        return s

    eot = profile.end_of_turn.id
    nonempty = L > 0
    last = np.where(nonempty, ids[np.maximum(off[1:] - 1, 0)] if len(ids) else -1, -1)
    prev = np.where(L > 1, ids[np.maximum(off[1:] - 2, 0)] if len(ids) else -1, -1)
    ends = last == eot
    if profile.guard is not None:
        ends |= (last == profile.guard.id) & (prev == eot)
    st["output.ends_with_eot"] = status(~ends, trunc)
    n_eot, f_eot = cnt("eot"), fst("eot")
    st["output.single_eot"] = status(np.where(trunc, n_eot != 0, n_eot != 1))

    n_close, f_close = cnt("reasoning_close"), fst("reasoning_close")
    n_open, f_open = cnt("reasoning_open"), fst("reasoning_open")
    has_close = n_close > 0
    if profile.prompt_ends_with_reasoning_open:
        rstart = np.zeros(n, np.int64)
        open_bad = n_open > 0
    else:  # qwen3 style: the output may start with <think>
        at0 = (n_open >= 1) & (f_open == 0)
        rstart = np.where(at0, 1, 0)
        open_bad = (n_open > 1) | ((n_open == 1) & ~at0)
    if profile.is_reasoning:
        st["output.single_reasoning_close"] = status(np.where(trunc, n_close > 1, n_close != 1))
        # a close at or after the first end-of-turn, or any close with no end-of-turn before it
        last_close = np.full(n, -1, np.int64)
        if len(rec):
            cl = code == code_of["reasoning_close"]
            np.maximum.at(last_close, rec[cl], rel[cl])
        st["output.close_before_eot"] = status(has_close & (n_eot > 0) & (last_close > f_eot))
        st["output.no_reasoning_open"] = status(open_bad)
        st["output.reasoning_nonempty"] = status(
            np.where(has_close, f_close <= rstart, ~(L > rstart)), ~has_close & ~trunc)
        astart = np.where(has_close, f_close + 1, 0)
        answer_na = trunc | ~has_close
    else:
        astart = np.zeros(n, np.int64)
        answer_na = trunc
    aend = np.where(n_eot > 0, f_eot, L)
    st["output.answer_nonempty"] = status(aend <= astart, answer_na)

    sections = pd.DataFrame({"record": [], "begin": [], "end": []}, dtype=np.int64)
    if tc is not None:
        tcodes = np.array([code_of[nm] for nm in tool_names])
        is_tool = np.isin(code, tcodes)
        trec, trel, tcode = rec[is_tool], rel[is_tool], code[is_tool]
        allowed, allowed_end = _tool_grammar(tc, code_of, K)
        prev_code = np.zeros(len(tcode), np.int64)  # 0 = start of the record
        if len(tcode):
            same = np.r_[False, trec[1:] == trec[:-1]]
            prev_code[same] = tcode[:-1][same[1:]]
        bad_step = ~allowed[prev_code, tcode]
        after_eot = (n_eot[trec] > 0) & (trel > f_eot[trec])
        bad = np.zeros(n, bool)
        bad[trec[bad_step | after_eot]] = True
        if len(tcode):
            is_last = np.r_[trec[1:] != trec[:-1], True]
            end_bad = ~allowed_end[tcode[is_last]] & ~trunc[trec[is_last]]
            bad[trec[is_last][end_bad]] = True
        st["output.tool_calls_balanced"] = status(bad)
        if profile.is_reasoning:
            inside = np.zeros(n, bool)
            ins = has_close[trec] & (trel < f_close[trec])
            inside[trec[ins]] = True
            st["output.tool_calls_outside_reasoning"] = status(inside, ~has_close)
        b_nm = "section_begin" if tc.section_begin is not None else "call_begin"
        e_nm = "section_end" if tc.section_end is not None else "call_end"
        bm, em = tcode == code_of[b_nm], tcode == code_of[e_nm]
        if bm.sum() == em.sum() and bm.any():
            sections = pd.DataFrame({"record": trec[bm], "begin": trel[bm], "end": trel[em]})
        elif bm.any():
            sections = pd.DataFrame({"record": trec[bm], "begin": trel[bm], "end": trel[bm]})

    oov = _out_of_range(ids, off, profile.vocab_size, (ids_lo, ids_hi))
    st["output.ids_in_vocab"] = status(oov)
    poov = _out_of_range(table.prompt, table.prompt_off, profile.vocab_size)
    s = np.where(poov, FAIL, PASS).astype(np.int8)
    s[~table.has_prompt] = NA
    st["prompt.ids_in_vocab"] = s

    tok_name = {c: nm for nm, c in code_of.items()}
    events = pd.DataFrame({"record": rec, "pos": rel, "token": [tok_name[c] for c in code.tolist()]})
    pos = Positions(f_close, f_eot, n_close, n_eot, n_open, rstart, sections, events)
    return st, pos


def _tool_grammar(tc: Any, code_of: dict[str, int], K: int) -> tuple[np.ndarray, np.ndarray]:
    """Allowed (previous tool token -> tool token) steps, and the tokens a record may end on."""
    allowed = np.zeros((K, K), bool)
    allowed_end = np.zeros(K, bool)
    c = code_of
    call_tail = "argument_begin" if tc.argument_begin is not None else None
    if tc.section_begin is not None:
        allowed[0, c["section_begin"]] = True
        allowed[c["section_end"], c["section_begin"]] = True
        allowed[c["section_begin"], c["call_begin"]] = True
        allowed[c["call_end"], c["section_end"]] = True
        allowed_end[c["section_end"]] = True
    else:
        allowed[0, c["call_begin"]] = True
        allowed_end[c["call_end"]] = True
    allowed[c["call_end"], c["call_begin"]] = True
    if call_tail:
        allowed[c["call_begin"], c[call_tail]] = True
        allowed[c[call_tail], c["call_end"]] = True
    else:
        allowed[c["call_begin"], c["call_end"]] = True
    return allowed, allowed_end


def generation_suffix(tokenizer: Any, profile: Profile) -> list[int]:
    """Ids the chat template appends as the generation prompt (with the profile's options)."""
    msgs = [{"role": "user", "content": "x"}]
    kw = dict(profile.template_kwargs)

    def ids(gen: bool) -> list[int]:
        r = tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=False, **kw)
        return list(r["input_ids"] if isinstance(r, dict) else r)

    a, b = ids(False), ids(True)
    if b[: len(a)] != a:
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return b[k:]
    return b[len(a):]


def suffix_check(table: IdTable, suffix: Sequence[int]) -> np.ndarray:
    """Per record: the prompt ends with `suffix` (vectorized gather of the last k ids)."""
    k = len(suffix)
    Lp = table.prompt_len
    if k == 0 or len(table.prompt) == 0:
        return np.where(table.has_prompt, PASS if k == 0 else FAIL, NA).astype(np.int8)
    idx = table.prompt_off[1:, None] - k + np.arange(k)[None, :]
    idx = np.clip(idx, 0, len(table.prompt) - 1)
    ok = (Lp >= k) & (table.prompt[idx] == np.asarray(suffix)[None, :]).all(axis=1)
    s = np.where(ok, PASS, FAIL).astype(np.int8)
    s[~table.has_prompt] = NA
    return s


def cross_record_checks(table: IdTable) -> dict[str, np.ndarray]:
    """Duplicate sample_ids within a dataset; identical outputs for different prompts."""
    n = len(table)
    meta = table.meta
    key = meta["dataset"].astype(str) + "\x00" + meta["sample_id"].astype(str)
    dup = key.duplicated(keep="first").to_numpy()
    st = {"dataset.unique_sample_id": np.where(dup, FAIL, PASS).astype(np.int8)}

    L = table.output_len
    distinct = np.zeros(n, np.int8)
    usable = table.has_output & (L > 0)
    distinct[~usable] = NA
    if usable.sum() > 1:
        ids, off = table.output, table.output_off
        # candidates share length and the ids at 9 spread positions (O(records), not O(tokens));
        # only they are compared in full below
        rows = np.flatnonzero(usable)
        start, span = off[:-1][rows], L[rows] - 1
        sig = pd.DataFrame({"L": L[rows]} | {f"at{k}": ids[start + span * k // 8] for k in range(9)}, index=rows)
        cand = sig.index[sig.duplicated(keep=False)].to_numpy()
        if len(cand):
            oh = [hash(table.output_ids(i).astype(np.int64).tobytes()) for i in cand]
            ph = [hash(table.prompt_ids(i).astype(np.int64).tobytes()) if table.has_prompt[i]
                  else hash(orjson.dumps(table.messages[i]) if table.messages else i) for i in cand]
            g = pd.DataFrame({"rec": cand, "out": oh, "prompt": ph})
            nprompts = g.groupby("out")["prompt"].transform("nunique")
            distinct[g.loc[nprompts > 1, "rec"].to_numpy()] = FAIL
    st["dataset.distinct_outputs"] = distinct
    return st


# --------------------------------------------------------------------------- tokenizer checks


def _norm(s: str) -> str:
    return " ".join(s.split())


def _body_spans(ids: np.ndarray, profile: Profile, pos: Positions, i: int) -> tuple[list[int] | None, list[int]]:
    """Reasoning ids and answer ids of record i (answer without tool sections and stop ids)."""
    stop = set(profile.stop_ids)
    L = len(ids)
    aend = int(pos.first_eot[i]) if pos.n_eot[i] > 0 else L
    if profile.is_reasoning:
        if pos.n_close[i] == 0:
            return [int(t) for t in ids[pos.reasoning_start[i]:aend]], []
        c = int(pos.first_close[i])
        reasoning = [int(t) for t in ids[pos.reasoning_start[i]:c]]
        answer = ids[c + 1 : aend]
    else:
        reasoning, answer = None, ids[:aend]
    ans = [int(t) for t in answer if t not in stop]
    tc = profile.tool_calls
    if tc is not None and ans:
        b = (tc.section_begin or tc.call_begin).id
        e = (tc.section_end or tc.call_end).id
        out, inside = [], False
        for t in ans:
            if t == b:
                inside = True
            elif t == e and inside:
                inside = False
            elif not inside:
                out.append(t)
        ans = out
    return reasoning, ans


def tokenizer_checks(table: IdTable, profile: Profile, tokenizer: Any, pos: Positions, *,
                     roundtrip: bool = True, progress: bool = False) -> dict[str, np.ndarray]:
    """Checks that need the tokenizer: prompt text, re-templating, roundtrip, text fields."""
    from .prompts import Prompt, template_prompt

    n = len(table)
    st = {k: np.full(n, NA, np.int8) for k in
          ("prompt.tools_present", "prompt.system_present", "prompt.retemplate", "text.fields_match")}
    st["text.roundtrip"] = np.full(n, NA if roundtrip else NOT_RUN, np.int8)
    fr = table.meta["finish_reason"].to_numpy(dtype=object)
    usable_out = table.has_output & ((fr == "stop") | (fr == "length"))
    msgs_all = table.messages or [None] * n
    tools_all = table.tools or [None] * n
    rows: Iterable[int] = range(n)
    if progress:
        from tqdm.auto import tqdm

        rows = tqdm(rows, desc="tokenizer checks", unit="record")
    for i in rows:
        msgs, tools = msgs_all[i], tools_all[i]
        if table.has_prompt[i]:
            pids = [int(t) for t in table.prompt_ids(i)]
            text = None
            if tools:
                text = text or _norm(tokenizer.decode(pids, skip_special_tokens=False))
                names = [(t.get("function") or t).get("name") for t in tools if isinstance(t, dict)]
                st["prompt.tools_present"][i] = PASS if all(nm and nm in text for nm in names) else FAIL
            sys_msgs = [m for m in (msgs or []) if isinstance(m, dict) and m.get("role") == "system"
                        and str(m.get("content") or "").strip()]
            if sys_msgs:
                text = text or _norm(tokenizer.decode(pids, skip_special_tokens=False))
                want = _norm(str(sys_msgs[0]["content"]))[:200]
                st["prompt.system_present"][i] = PASS if want in text else FAIL
            if msgs:
                try:
                    again = template_prompt(tokenizer, Prompt(str(table.meta.at[i, "dataset"]),
                                                              table.meta.at[i, "sample_id"], msgs, tools), profile)
                    st["prompt.retemplate"][i] = PASS if again == pids else FAIL
                except Exception:  # a template that cannot render these messages is a failure too
                    st["prompt.retemplate"][i] = FAIL
        if not usable_out[i]:
            continue
        oids = table.output_ids(i)
        if roundtrip:
            lst = [int(t) for t in oids]
            again = tokenizer.encode(tokenizer.decode(lst, skip_special_tokens=False), add_special_tokens=False)
            st["text.roundtrip"][i] = PASS if list(again) == lst else FAIL
        reasoning_f = table.reasoning[i] if table.reasoning else None
        content_f = table.content[i] if table.content else None
        if reasoning_f is None and content_f is None:
            continue
        r_ids, a_ids = _body_spans(oids, profile, pos, i)
        ok = True
        if reasoning_f is not None and r_ids is not None:
            ok &= _norm(tokenizer.decode(r_ids, skip_special_tokens=False)) == _norm(reasoning_f)
        if content_f is not None:
            ok &= _norm(tokenizer.decode(a_ids, skip_special_tokens=False)) == _norm(content_f)
        st["text.fields_match"][i] = PASS if ok else FAIL
    return st


# --------------------------------------------------------------------------- the audit


@dataclass
class AuditResult:
    """Statuses of every record for every check, with the tables and numbers built on them."""

    table: IdTable
    profile: Profile
    status: pd.DataFrame  # one row per record, one int8 column per check
    positions: Positions
    tokenizer_used: bool
    seconds: float
    ledger: dict[str, Any] | None = None
    skipped_lengths: pd.DataFrame | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def meta(self) -> pd.DataFrame:
        return self.table.meta

    def failed_lists(self) -> list[list[str]]:
        """Per record, the names of the checks it failed."""
        fails = self.status.to_numpy() == FAIL
        cols = np.array(self.status.columns)
        return [cols[row].tolist() for row in fails]

    def verdicts(self) -> pd.DataFrame:
        """One row per record: dataset, sample_id, failed check names, truncated."""
        m = self.meta
        return pd.DataFrame({"dataset": m["dataset"], "sample_id": m["sample_id"], "failed": self.failed_lists(),
                             "truncated": (m["finish_reason"] == "length").to_numpy()})

    def group_keys(self) -> pd.DataFrame:
        m = self.meta
        return pd.DataFrame({"dataset": m["dataset"].astype(str), "source": m["source"].fillna("?").astype(str),
                             "provider": m["provider"].fillna("-").astype(str)})

    def check_table(self, by_group: bool = True) -> pd.DataFrame:
        """Honest numbers: per (dataset, source, provider) and check, counts and the 95 % bound.

        `upper95` is the rule-of-three bound 3/n when a check saw zero failures in n applicable
        records (else the Wilson 95 % upper bound); `records_for_0.1%` is how many applicable
        records a clean check needs before its bound drops to 0.1 %.
        """
        keys = self.group_keys() if by_group else pd.DataFrame({"dataset": ["(all)"] * len(self.meta)})
        gcols = list(keys.columns)
        long = self.status.copy()
        for c in gcols:
            long[c] = keys[c].to_numpy()
        long = long.melt(id_vars=gcols, var_name="check", value_name="status")
        agg = long.groupby(gcols + ["check"], sort=False)["status"].agg(
            records="size", failed=lambda s: int((s == FAIL).sum()), passed=lambda s: int((s == PASS).sum()),
            not_applicable=lambda s: int((s == NA).sum()), not_run=lambda s: int((s == NOT_RUN).sum())).reset_index()
        cnt_cols = ["records", "failed", "passed", "not_applicable", "not_run"]
        agg[cnt_cols] = agg[cnt_cols].astype(np.int64)
        agg["applicable"] = agg["passed"] + agg["failed"]
        agg["fail_rate"] = np.where(agg["applicable"] > 0, agg["failed"] / agg["applicable"].clip(lower=1), np.nan)
        agg["upper95"] = [upper95(f, a) for f, a in zip(agg["failed"], agg["applicable"])]
        need = math.ceil(3 / TARGET_RATE)
        clean = (agg["failed"] == 0) & (agg["applicable"] > 0)
        agg["records_for_0.1%"] = np.where(clean, need, np.nan)
        agg["more_needed"] = np.where(clean, np.maximum(0, need - agg["applicable"]), np.nan)
        agg["verdict"] = [_verdict(r) for r in agg.itertuples()]
        return agg

    def check_summary(self) -> pd.DataFrame:
        """One row per check over all records: the table to read first."""
        t = self.check_table(by_group=False).drop(columns=["dataset"]).set_index("check")
        t.insert(0, "what", [CHECKS[c].what for c in t.index])
        return t

    def check_matrix(self) -> pd.DataFrame:
        """Wide view: one row per (dataset, source, provider), one column per applicable check."""
        ct = self.check_table()
        ct = ct[ct["check"].isin([c.name for c in iter_checks(self.profile)])]
        short = np.where(ct["failed"] > 0, "FAIL " + ct["failed"].astype(str) + "/" + ct["applicable"].astype(str),
                         np.where(ct["applicable"] > 0, "0/" + ct["applicable"].astype(str) + " (<"
                                  + (ct["upper95"] * 100).round(1).astype(str) + "%)",
                                  np.where(ct["not_run"] > 0, "not run", "n/a")))
        ct = ct.assign(cell=short)
        wide = ct.pivot_table(index=["dataset", "source", "provider"], columns="check", values="cell",
                              aggfunc="first", sort=False)
        return wide[[c for c in CHECK_NAMES if c in wide.columns]]

    def group_table(self) -> pd.DataFrame:
        """Per (dataset, source, provider): records, truncated, records with any failure."""
        keys = self.group_keys()
        fails = (self.status.to_numpy() == FAIL).any(axis=1)
        df = keys.assign(records=1, truncated=(self.meta["finish_reason"] == "length").to_numpy(),
                         errors=self.meta["finish_reason"].isin(["error", "abort"]).to_numpy(), failed=fails,
                         output_tokens=self.table.output_len, prompt_tokens=self.table.prompt_len)
        return df.groupby(list(keys.columns)).sum().reset_index()

    def failing(self, check: str, k: int = 3) -> pd.DataFrame:
        """The first k records that failed `check` (dataset, sample_id, line)."""
        idx = np.flatnonzero(self.status[check].to_numpy() == FAIL)[:k]
        return self.meta.iloc[idx][["dataset", "sample_id", "file", "line"]]

    def lengths(self) -> pd.DataFrame:
        """Per record: prompt, reasoning, answer and output lengths in tokens, plus positions."""
        p = self.positions
        L = self.table.output_len
        has_close = p.n_close > 0
        reasoning = np.where(has_close, p.first_close - p.reasoning_start, np.nan) if self.profile.is_reasoning \
            else np.full(len(L), np.nan)
        aend = np.where(p.n_eot > 0, p.first_eot, L)
        answer = np.where(has_close, aend - p.first_close - 1, aend) if self.profile.is_reasoning else aend
        df = pd.DataFrame({"dataset": self.meta["dataset"].astype(str), "sample_id": self.meta["sample_id"],
                           "finish_reason": self.meta["finish_reason"], "prompt": self.table.prompt_len,
                           "output": L, "reasoning": reasoning, "answer": answer,
                           "close_pos": np.where(has_close, p.first_close, np.nan),
                           "eot_pos": np.where(p.n_eot > 0, p.first_eot, np.nan)})
        return df[self.table.has_output]

    def record_index(self, dataset: str | None, sample_id: Any) -> int | None:
        """Row of (dataset, sample_id) in the table (any dataset when None), or None."""
        m = self.meta
        hit = m["sample_id"].astype(str) == str(sample_id)
        if dataset is not None:
            hit &= m["dataset"].astype(str) == str(dataset)
        idx = np.flatnonzero(hit.to_numpy())
        return int(idx[0]) if len(idx) else None

    def summary(self) -> dict[str, Any]:
        """What `summary.json` holds: counts per check and group, bounds, what was not run."""
        cs = self.check_summary()
        checks = {}
        for name, r in cs.iterrows():
            checks[name] = {"what": r["what"], "applicable": int(r["applicable"]), "failed": int(r["failed"]),
                            "not_applicable": int(r["not_applicable"]), "not_run": int(r["not_run"]),
                            "upper95": None if pd.isna(r["upper95"]) else float(r["upper95"]),
                            "verdict": r["verdict"]}
        groups = self.group_table()
        ct = self.check_table()
        fails = ct[ct["failed"] > 0][["dataset", "source", "provider", "check", "failed", "applicable"]]
        return {
            "profile": self.profile.name,
            "records": len(self.meta),
            "output_tokens": int(self.table.output_len.sum()),
            "prompt_tokens": int(self.table.prompt_len.sum()),
            "records_failed": int((self.status.to_numpy() == FAIL).any(axis=1).sum()),
            "records_truncated": int((self.meta["finish_reason"] == "length").sum()),
            "tokenizer_checks": "run" if self.tokenizer_used else "not run (no tokenizer)",
            "checks": checks,
            "groups": _jsonable(groups.to_dict(orient="records")),
            "failures": _jsonable(fails.to_dict(orient="records")),
            "ids_from": _jsonable(self.meta.get("ids_from", pd.Series(dtype=str)).value_counts().to_dict()),
            "bad_lines": self.table.bad_lines,
            "torn_tail_bytes": self.table.torn_tail_bytes,
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
        }

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write `verdicts.jsonl` and `summary.json` into out_dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        m = self.meta
        trunc = (m["finish_reason"] == "length").to_numpy()
        lines = [orjson.dumps({"dataset": d, "sample_id": _py(s), "failed": f, "truncated": bool(t)})
                 for d, s, f, t in zip(m["dataset"], m["sample_id"], self.failed_lists(), trunc)]
        vp, sp = out / "verdicts.jsonl", out / "summary.json"
        tmp = vp.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"\n".join(lines) + (b"\n" if lines else b""))
        tmp.replace(vp)
        sp.write_bytes(orjson.dumps(self.summary(), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        return vp, sp


def _py(x: Any) -> Any:
    return x.item() if isinstance(x, np.generic) else x


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def upper95(failed: int, n: int) -> float:
    """95 % upper bound on a failure rate: rule of three (3/n) at zero failures, else Wilson."""
    if n <= 0:
        return float("nan")
    if failed == 0:
        return min(1.0, 3.0 / n)
    z = 1.959964
    p = failed / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + half) / (1 + z * z / n))


def _verdict(r: Any) -> str:
    if r.not_run and not r.applicable:
        return "not run"
    if not r.applicable:
        return "n/a"
    if r.failed:
        return f"FAIL {r.failed}/{r.applicable}"
    return f"0/{r.applicable} (< {r.upper95:.2%})"


def audit_table(table: IdTable, profile: Profile, *, tokenizer: Any = None, roundtrip: bool = True,
                progress: bool = False) -> AuditResult:
    """Run every check that applies to this profile on an IdTable."""
    t0 = time.perf_counter()
    n = len(table)
    fr = table.meta["finish_reason"].to_numpy(dtype=object)
    st: dict[str, np.ndarray] = {
        "record.complete": np.where(np.isin(fr, ["stop", "length"]), PASS, FAIL).astype(np.int8),
        "record.has_ids": np.where(table.has_output & table.has_prompt, PASS, FAIL).astype(np.int8),
    }
    st["record.has_ids"][~np.isin(fr, ["stop", "length"])] = NA
    s2, pos = structural_checks(table, profile)
    st.update(s2)
    if tokenizer is not None:
        st["prompt.generation_prompt"] = suffix_check(table, generation_suffix(tokenizer, profile))
    elif profile.prompt_ends_with_reasoning_open and profile.reasoning_open is not None:
        st["prompt.generation_prompt"] = suffix_check(table, [profile.reasoning_open.id])
    if tokenizer is not None:
        st.update(tokenizer_checks(table, profile, tokenizer, pos, roundtrip=roundtrip, progress=progress))
    st.update(cross_record_checks(table))
    cols = {}
    for c in CHECK_NAMES:
        chk = CHECKS[c]
        if not chk.applies(profile):
            cols[c] = np.full(n, NA, np.int8)
        elif c in st:
            cols[c] = st[c]
        else:
            cols[c] = np.full(n, NOT_RUN, np.int8)
    status = pd.DataFrame(cols)
    notes = []
    if tokenizer is None:
        notes.append("no tokenizer: " + ", ".join(c for c in CHECK_NAMES if (status[c] == NOT_RUN).all() and n)
                     + " not run")
    return AuditResult(table, profile, status, pos, tokenizer is not None, time.perf_counter() - t0, notes=notes)


# --------------------------------------------------------------------------- ledger and damage assessment


def ledger_table(ledger: dict[str, Any] | None) -> pd.DataFrame:
    """The 01_generate ledger per dataset: planned, done, skipped, errors, cancelled, cost."""
    if not ledger:
        return pd.DataFrame()
    rows = []
    for name, d in ledger.get("datasets", {}).items():
        rows.append({"dataset": name, "planned": d.get("planned", 0), "done": d.get("done", 0),
                     "errors": d.get("errors", 0), "skipped": d.get("skipped", 0),
                     "cancelled": len(d.get("cancelled_ids") or []), "resumed": d.get("resumed", 0),
                     "prompt_tokens": d.get("prompt_tokens", 0), "completion_tokens": d.get("completion_tokens", 0),
                     "cost_usd": d.get("cost_usd", 0.0)})
    df = pd.DataFrame(rows).set_index("dataset")
    df["missing"] = df["planned"] - df["done"] - df["errors"] - df["skipped"] - df["cancelled"]
    return df


def prompt_length_groups(params: Any, result: AuditResult, tokenizer: Any) -> pd.DataFrame:
    """Prompt lengths of done vs. skipped vs. cancelled samples, so a biased budget cut shows."""
    from .prompts import load_datasets, template_prompt

    m = result.meta
    df = pd.DataFrame({"dataset": m["dataset"].astype(str), "group": "done", "prompt_tokens": result.table.prompt_len})
    df = df[result.table.has_prompt & m["finish_reason"].isin(["stop", "length"]).to_numpy()]
    ledger = result.ledger or {}
    wanted: dict[str, dict[str, str]] = {}
    for name, d in ledger.get("datasets", {}).items():
        for grp in ("skipped", "cancelled"):
            for sid in d.get(f"{grp}_ids") or []:
                wanted.setdefault(name, {})[str(sid)] = grp
    if not wanted or tokenizer is None:
        return df.reset_index(drop=True)
    profile = get_profile(params.profile)
    rows = []
    for name, ps in load_datasets(params).items():
        w = wanted.get(name)
        if not w:
            continue
        for p in ps.prompts:
            grp = w.get(str(p.sample_id))
            if grp:
                rows.append({"dataset": name, "group": grp, "prompt_tokens": len(template_prompt(tokenizer, p, profile))})
    return pd.concat([df, pd.DataFrame(rows)], ignore_index=True)


def run_audit(params: Any, progress: bool = True, *, tokenizer: Any = None) -> AuditResult:
    """Stage 03: audit every record of the run; write `audit/verdicts.jsonl` and `audit/summary.json`."""
    from .generate import read_ledger
    from .models import tokenizer_for
    from .provenance import write_provenance

    run_dir = params.run_dir
    if not (run_dir / "records").is_dir():
        raise FileNotFoundError(f"no records at {run_dir / 'records'}: run 01_generate first")
    write_provenance(run_dir, "03_audit", params)
    profile = get_profile(params.profile)
    tokenizer = tokenizer or tokenizer_for(params)
    table = load_run(run_dir, source_fields=True)
    result = audit_table(table, profile, tokenizer=tokenizer, roundtrip=params.audit.roundtrip, progress=progress)
    result.ledger = read_ledger(run_dir)
    if not (run_dir / "reconstruct").is_dir() and (table.meta["source"] == "api").any():
        result.notes.append("no reconstruct/ folder: API records have no ids until 02_reconstruct runs")
    result.skipped_lengths = prompt_length_groups(params, result, tokenizer)
    result.write(run_dir / "audit")
    return result


def audit_cli(records: str, *, profile: str, out: str, tokenizer: str | None = None) -> int:
    """`python -m eagle3data audit RECORDS --profile NAME --out DIR [--tokenizer PATH]`."""
    import sys

    try:
        prof = get_profile(profile)
    except KeyError as e:
        print(f"audit: {e.args[0]}", file=sys.stderr)
        return 2
    path = Path(records)
    paths = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    tok = None
    try:
        if not paths:
            raise AuditInputError(f"{path}: no *.jsonl journals in this folder")
        if tokenizer:
            from .models import load_tokenizer

            tok = load_tokenizer(tokenizer, trust_remote_code=True, profile=prof)
        tables = [read_journal(p, source_fields=tok is not None) for p in paths]
        table = concat_tables(tables)
        if table.bad_lines:
            raise AuditInputError("unreadable lines:\n  " + "\n  ".join(table.bad_lines[:20]))
        if len(table) == 0:
            raise AuditInputError(f"{path}: no records")
        run_dir = path.parent if path.is_dir() else path.parent.parent
        table = merge_reconstruct(table, run_dir)
    except (AuditInputError, OSError) as e:
        print(f"audit: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a profile/tokenizer mismatch and the like
        print(f"audit: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    result = audit_table(table, prof, tokenizer=tok)
    vp, sp = result.write(out)
    s = result.summary()
    print(f"audited {s['records']} records ({s['output_tokens']} output tokens) in {result.seconds:.2f} s: "
          f"{s['records_failed']} failed, {s['records_truncated']} truncated; tokenizer checks {s['tokenizer_checks']}")
    for name, c in s["checks"].items():
        if c["failed"]:
            print(f"  {name}: {c['failed']}/{c['applicable']} failed")
    print(f"wrote {vp} and {sp}")
    return 0


def iter_checks(profile: Profile) -> Iterable[Check]:
    """The checks that apply to a profile."""
    return (c for c in _CHECK_LIST if c.applies(profile))
