"""A run audited in chunks: memory set by `audit.chunk_records`, not by the run.

`LineAudit` takes the run's journal lines a chunk at a time (an `IdTable` of at most `chunk_records`
lines, 02's rebuilt ids merged in), runs every per-record check on it (`checks`, `textchecks`) and
keeps of each line only its small facts: its statuses (an int8 per check), where its special tokens
sit, its lengths, its key and metadata, where it is in its journal, a 128-bit hash of its output and
of its prompt (`checks.record_hashes`) and, for a turn record, the hashes of its reply and its
history (`checks.on_policy_facts`). The chunk's ids and texts are let go. `finish` applies the
supersede rule to every line's key (`runtable.supersede_lines`) and gives the records' facts, on which
the checks across records run (`cross_record_checks`, `on_policy_checks`, `billed_prompt_checks`). The chunks
come from `journal_chunks` (one journal's lines) or `file_chunks` (records files one after the other: a run's
journals for the stage; any journal, folder of journals or .parquet for the CLI, `command`).

Every per-record check depends on its record alone, so the verdicts do not depend on the chunk size:
`run.audit_table` audits a table held in memory as one chunk, through the same code. (A superseded
line, rare, is checked with its chunk and its facts dropped at `finish`: one pass over the journal.)
The tokenizer's part of a chunk (`textchecks.run_text_checks`: its batch decode/encode calls, which
run on every core outside the GIL) runs in a thread of its own while the next chunk is read, merged
and checked, so the Python work and the tokenizer's overlap; two chunks are held at most.

`RecordFacts` is the records' table without ids or texts (what the summary, plots, ledger and check
table read); the inspector's one record is read back from its journal line on demand (`row`).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson
import pandas as pd

from eagle3data.audit.checks import Positions, on_policy_facts, record_hashes
from eagle3data.audit.idtable import IdTable, RecordLengths, parquet_tables, read_lines
from eagle3data.audit.rebuilt import RebuiltIds
from eagle3data.audit.runtable import merge_reconstruct, supersede_lines
from eagle3data.audit.textchecks import TextWork, prepare_text_checks, run_text_checks
from eagle3data.core.profiles import Profile

SOURCE_FIELDS = ("messages", "tools", "reasoning", "content", "loss_mask", "tool_calls")
_LINE_ENDS = re.compile(rb"\r\n|\r|\n")


# --------------------------------------------------------------------------- journals in chunks of lines


@dataclass
class Chunk:
    """Up to `chunk_records` consecutive lines of one journal: the table read from them, and each row's byte offset."""

    table: IdTable
    starts: np.ndarray  # byte offset of each row's line in its journal
    size: int = 0  # bytes of the journal the chunk's lines take


def _line_starts(data: bytes) -> np.ndarray:
    """Byte offset of each line of `data` (lines as the readers number them: split at \\n, or also at \\r)."""
    if b"\r" in data:
        return np.asarray([0] + [m.end() for m in _LINE_ENDS.finditer(data)][:-1], np.int64)
    nl = np.flatnonzero(np.frombuffer(data, np.uint8) == 10)
    return np.r_[0, nl[:-1] + 1].astype(np.int64)


def journal_chunks(path: Path, chunk: int) -> Iterator[Chunk | int]:
    """The journal's lines as `Chunk`s of at most `chunk` lines, in order; last, the size of a torn tail (bytes
    after the last newline: a write cut off), 0 when none. Numbers lines and names bad lines as `read_journal`;
    a journal without a whole line is one empty chunk (`read_journal`'s empty table)."""
    first_line = offset = torn = 0
    lines: list[bytes] = []

    def flush() -> Chunk:
        nonlocal first_line, offset
        data = b"".join(lines)
        lines.clear()
        t = read_lines(path, data, first_line=first_line)
        starts = _line_starts(data)[t.meta["line"].to_numpy(np.int64) - first_line - 1] + offset
        first_line += data.count(b"\n") if b"\r" not in data else len(data.splitlines())
        offset += len(data)
        return Chunk(t, starts, len(data))

    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                torn = len(line)
                break
            lines.append(line)
            if len(lines) >= chunk:
                yield flush()
    if lines:
        yield flush()
    elif not offset:
        yield Chunk(read_lines(path, b""), np.zeros(0, np.int64))
    yield torn


def file_chunks(paths: Iterable[Path], chunk: int) -> Iterator[tuple[int, Chunk | int]]:
    """Records files in chunks of at most `chunk` lines, file after file: `(k, Chunk)`, k counting each file's chunks
    from 0, and after each file `(k, torn tail bytes)`. A journal's chunks are `journal_chunks`', a columnar file's
    (.parquet) its record batches (`idtable.parquet_tables`: rows numbered as lines, no byte offsets, no torn tail)."""
    for path in paths:
        if path.suffix == ".parquet":
            yield from enumerate(chain((Chunk(t, np.full(len(t), -1, np.int64)) for t in parquet_tables(path, chunk)),
                                       [0]))
        else:
            yield from enumerate(journal_chunks(path, chunk))


# --------------------------------------------------------------------------- the records' table without ids


def _offsets(lens: np.ndarray) -> np.ndarray:
    off = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    return off


class _LazyField:
    """`facts.messages[i]` (and the other text fields): record i's value, read back from its line when asked."""

    def __init__(self, facts: RecordFacts, name: str) -> None:
        self.facts, self.name = facts, name

    def __len__(self) -> int:
        return len(self.facts)

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < len(self.facts):
            raise IndexError(i)
        return getattr(self.facts.row(i), self.name)[0]


class RecordFacts(RecordLengths):
    """The run's records as `IdTable` is read by the summary, plots and check table: metadata, lengths (by their
    offsets, as `IdTable`'s: `RecordLengths`) and presence of ids, bad lines and the torn tail, without the ids or
    texts. `row(i)` reads record i back from its journal line (02's rebuilt ids merged), for the inspector:
    `output_ids(i)`, `prompt_ids(i)` and the text fields (`messages[i]`, ...) go through it."""

    def __init__(self, meta: pd.DataFrame, prompt_len: np.ndarray, output_len: np.ndarray, has_prompt: np.ndarray,
                 has_output: np.ndarray, starts: np.ndarray, rebuilt: RebuiltIds | None, run_dir: Path | None) -> None:
        self.meta = meta
        self.prompt_off, self.output_off = _offsets(prompt_len), _offsets(output_len)
        self.has_prompt, self.has_output = has_prompt, has_output
        self.starts = starts
        self.bad_lines: list[str] = []
        self.torn_tail_bytes = 0
        self.rebuilt, self._run_dir = rebuilt, run_dir  # 02's lines, read when a record is
        self._rows: OrderedDict[int, IdTable] = OrderedDict()
        for name in SOURCE_FIELDS:
            setattr(self, name, _LazyField(self, name))

    @property
    def n_tokens(self) -> int:
        return int(self.output_off[-1] + self.prompt_off[-1])

    def row(self, i: int) -> IdTable:
        """Record i as a one-row table with its text fields, read from its journal line (the last few kept)."""
        i = int(i)
        if i in self._rows:
            self._rows.move_to_end(i)
            return self._rows[i]
        m = self.meta.iloc[i]
        path = Path(m["file"])
        with open(path, "rb") as f:
            f.seek(int(self.starts[i]))
            line = f.readline()
        line = line.splitlines()[0] + b"\n" if line.strip() else line
        t = read_lines(path, line, first_line=int(m["line"]) - 1)
        if self.rebuilt is not None and m.get("ids_from") == "reconstruct":
            t = merge_reconstruct(t, self._run_dir or path.parent.parent, self.rebuilt.wholes())
        self._rows[i] = t
        while len(self._rows) > 4:
            self._rows.popitem(last=False)
        return t

    def line(self, i: int) -> dict[str, Any]:
        """Record i's journal line as written (parsed whole)."""
        with open(self.meta["file"].iat[int(i)], "rb") as f:
            f.seek(int(self.starts[int(i)]))
            return orjson.loads(f.readline())

    def output_ids(self, i: int) -> np.ndarray:
        return self.row(i).output_ids(0)

    def prompt_ids(self, i: int) -> np.ndarray:
        return self.row(i).prompt_ids(0)


# --------------------------------------------------------------------------- the audit of lines, chunk by chunk


_SHARED = ("dataset", "source", "provider", "finish_reason", "profile", "model", "file", "ids_from", "proof_level")


class _Rows:
    """Fixed-width rows of facts appended chunk by chunk into one array (capacity doubled as it fills)."""

    def __init__(self, width: int, dtype: Any) -> None:
        self.a = np.zeros((0, width), dtype)
        self.n = 0

    def add(self, x: np.ndarray) -> None:
        x = np.asarray(x).reshape(len(x), self.a.shape[1])
        if self.n + len(x) > len(self.a):
            grown = np.empty((max(2 * len(self.a), self.n + len(x), 256), self.a.shape[1]), self.a.dtype)
            grown[: self.n] = self.a[: self.n]
            self.a = grown
        self.a[self.n : self.n + len(x)] = x
        self.n += len(x)

    def get(self) -> np.ndarray:
        return self.a[: self.n]


class _Meta:
    """One journal's metadata, chunk by chunk: its first chunk's frame as it is, later chunks' values appended to
    per-column lists (repeated texts shared), so that the frame is typed as if read at once (`frame`)."""

    def __init__(self, shared: dict[Any, Any]) -> None:
        self.frame: pd.DataFrame | None = None
        self.cols: dict[str, list[Any]] | None = None
        self.rows = 0
        self.shared = shared

    def _values(self, name: str, col: pd.Series) -> list[Any]:
        vals = [None if isinstance(v, float) and v != v else v for v in col.tolist()]  # JSON has no NaN: a null
        if name in _SHARED:
            vals = [self.shared.setdefault(v, v) if isinstance(v, str) else v for v in vals]
        return vals

    def add(self, meta: pd.DataFrame) -> None:
        if self.frame is None and self.cols is None:
            self.frame, self.rows = meta, len(meta)
            return
        if self.cols is None:
            self.cols = {c: self._values(c, self.frame[c]) for c in self.frame.columns}
            self.frame = None
        for c in meta.columns:
            self.cols.setdefault(c, [None] * self.rows).extend(self._values(c, meta[c]))
        self.rows += len(meta)
        for vals in self.cols.values():
            vals.extend([None] * (self.rows - len(vals)))

    def table(self) -> pd.DataFrame:
        return self.frame if self.frame is not None else pd.DataFrame(self.cols)


_POS = ("first_close", "first_eot", "n_close", "n_eot", "n_open", "reasoning_start")


@dataclass
class LineAudit:
    """Per-record checks of a run's lines, fed a chunk at a time (`add`); `finish` gives the records' facts.

    What is kept of a line: its metadata (`_Meta`), and fixed-width rows: its statuses (int8 per check), the
    positions of its special tokens, its lengths and presence of ids, its hashes, its byte offset; its special
    tokens' events and tool sections as (line, position, ...) rows; a turn record's on-policy facts."""

    profile: Profile
    id_checks: Callable[[IdTable], tuple[dict[str, np.ndarray], Positions]]  # a chunk's statuses by its ids alone
    tokenizer: Any = None
    roundtrip: bool = True
    hash_ids: bool = True  # keep each line's hashes (False: the caller keeps the ids, `cross_record_checks` hashes)
    lines: int = 0
    bad_lines: list[str] = field(default_factory=list)
    torn_tail_bytes: int = 0

    def __post_init__(self) -> None:
        self._meta: list[_Meta] = []
        self._shared: dict[Any, Any] = {}
        self._checks: list[str] | None = None
        self._status: _Rows | None = None
        self._pending: list[tuple[Future | None, dict[str, np.ndarray]]] = []
        self._pos, self._lens, self._has = _Rows(len(_POS), np.int64), _Rows(2, np.int64), _Rows(2, bool)
        self._hashes, self._starts = _Rows(4, np.uint64), _Rows(1, np.int64)
        self._events, self._sections = _Rows(3, np.int64), _Rows(3, np.int64)
        self._tokens: Any = None  # the events' token categories
        self._turns: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None

    def _text_checks(self, work: TextWork, st: dict[str, np.ndarray]) -> None:
        st.update(run_text_checks(work, self.profile, self.tokenizer))

    def _drain(self, keep: int) -> None:
        """Wait for the tokenizer checks in flight until at most `keep` are (the chunk each holds is then let go),
        and keep the statuses of the chunks done."""
        while len(self._pending) > keep:
            job, st = self._pending.pop(0)
            if job is not None:
                job.result()
            if self._status is None:
                self._checks = list(st)
                self._status = _Rows(len(self._checks), np.int8)
            self._status.add(np.stack([st[c] for c in self._checks], axis=1) if self._checks
                             else np.zeros((len(st.get("record.complete", ())), 0), np.int8))

    def add(self, table: IdTable, starts: np.ndarray | None = None, *, new_file: bool = True) -> None:
        """Check a chunk's lines and keep their facts (the table may then be let go); `new_file`: its lines begin a
        journal (else they go on the last one's)."""
        n = len(table)
        self.bad_lines += table.bad_lines
        self.torn_tail_bytes += table.torn_tail_bytes
        st, pos = self.id_checks(table)
        job = None
        if self.tokenizer is not None:  # the batch calls in the tokenizer's thread, beside the next chunk's reading
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="audit-tokenizer")
            work = prepare_text_checks(table, self.profile, self.tokenizer, roundtrip=self.roundtrip)
            self._drain(keep=0)
            job = self._pool.submit(self._text_checks, work, st)
        self._pending.append((job, st))
        if job is None:
            self._drain(keep=0)
        if new_file or not self._meta:
            self._meta.append(_Meta(self._shared))
        self._meta[-1].add(table.meta)
        self._pos.add(np.stack([getattr(pos, k) for k in _POS], axis=1))
        ev, sec = pos.events, pos.tool_sections
        self._tokens = ev["token"].cat.categories
        self._events.add(np.stack([ev["record"].to_numpy(np.int64) + self.lines, ev["pos"].to_numpy(np.int64),
                                   ev["token"].cat.codes.to_numpy(np.int64)], axis=1))
        self._sections.add(np.stack([sec["record"].to_numpy(np.int64) + self.lines, sec["begin"].to_numpy(np.int64),
                                     sec["end"].to_numpy(np.int64)], axis=1))
        self._lens.add(np.stack([table.prompt_len, table.output_len], axis=1))
        self._has.add(np.stack([table.has_prompt, table.has_output], axis=1))
        if self.hash_ids:
            self._hashes.add(record_hashes(table, np.arange(self.lines, self.lines + n)))
        self._turns += on_policy_facts(table)
        self._starts.add(np.full(n, -1, np.int64) if starts is None else starts)
        self.lines += n

    def finish(self, rebuilt: RebuiltIds | None = None, run_dir: Path | None = None
               ) -> tuple[np.ndarray, RecordFacts, dict[str, np.ndarray], Positions, np.ndarray | None, list,
                          pd.DataFrame]:
        """(the rows of the records among all lines, their facts, statuses, positions, hashes and turn facts, the
        superseded lines)."""
        self._drain(keep=0)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if not self._meta:
            raise ValueError("LineAudit.finish before any chunk")
        frames = [m.table() for m in self._meta]
        meta = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)  # as runtable.concat_tables
        rec, dup, superseded = supersede_lines(meta)
        every = len(rec) == self.lines  # nothing superseded: every line is a record, nothing to pick or renumber
        sel: Any = slice(None) if every else rec
        if not every:
            meta = meta.iloc[rec].reset_index(drop=True)
        meta["duplicate"] = dup
        lens, has = self._lens.get()[sel], self._has.get()[sel]
        facts = RecordFacts(meta, lens[:, 0], lens[:, 1], has[:, 0], has[:, 1], self._starts.get()[sel, 0],
                            rebuilt, run_dir)
        facts.bad_lines, facts.torn_tail_bytes = self.bad_lines, self.torn_tail_bytes
        grid = self._status.get()[sel] if self._status is not None else np.zeros((len(rec), 0), np.int8)
        st = {c: grid[:, j].copy() for j, c in enumerate(self._checks or [])}
        new = np.full(self.lines, -1, np.int64)
        new[rec] = np.arange(len(rec))

        def renumbered(rows: np.ndarray) -> np.ndarray:
            if every:
                return rows
            r = new[rows[:, 0]]
            return np.column_stack([r, rows[:, 1:]])[r >= 0]

        ev, sec = renumbered(self._events.get()), renumbered(self._sections.get())
        p = self._pos.get()[sel]
        pos = Positions(*(p[:, j] for j in range(len(_POS))),
                        tool_sections=pd.DataFrame({"record": sec[:, 0], "begin": sec[:, 1], "end": sec[:, 2]}),
                        events=pd.DataFrame({"record": ev[:, 0], "pos": ev[:, 1], "token": pd.Categorical.from_codes(
                            ev[:, 2], categories=self._tokens)}))
        return (rec, facts, st, pos, self._hashes.get()[sel] if self.hash_ids else None,
                self._turns if every else [self._turns[i] for i in rec.tolist()], superseded)
