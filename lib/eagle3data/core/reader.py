"""The one reader of a run: its journals, 02's rebuilt ids and 03's verdicts, under one key.

Every stage after 01 reads a run through here (03 reads the journals' ids through its fast
array reader, `audit.idtable`, and applies the same rule on arrays, `supersede_codes` on
`SampleKey.codes_of_frame`, in `audit.runtable`):

- **One key.** A sample is `SampleKey.of(row)`, written `dataset/sample_id` (`#turn` for a turn).
- **The latest journal line per key is the record** (its latest *completed* line when an
  error was journaled after a response). The key's other lines are *superseded*: a retried
  error (or abort) is not a failure and not a duplicate. A key with two completed lines
  (stop or length) is a real duplicate: its latest is still the record, marked `duplicate`
  (03 fails `dataset.unique_sample_id`; the selection drops it with reason `duplicate_key`).
- **One training sequence per record** (`resolve`): exact `prompt_ids + output_ids` (mask 0
  on the prompt, 1 on the output) when the record has both, else 02's rebuilt
  `input_ids`/`loss_mask`, else none.

Malformed input raises `RunFileError` naming the file, line and field(s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import orjson

from eagle3data.core.errors import UserInputError
from eagle3data.core.records import scan_journal

COMPLETED = ("stop", "length")  # finish reasons of a record that holds a response


class SampleKey(str):
    """The one key of a sample in every stage, made only from its row: `SampleKey.of(row)`.

    The text `dataset/sample_id` (sample_id as text), or `dataset/sample_id#turn` for a turn of a
    conversation regenerated turn by turn (`generate.turns: all`, a row with a `turn`): each turn
    is its own sample (its own supersede rule, its own training sequence). A `str` (the dict key,
    the parquet `key` value and the trainer id as it is) whose parts are attributes: `dataset`,
    `sample_id` (the row's own id, never with the turn), `turn` (int or None), and
    `conversation` (the key of the whole conversation). Dataset names hold no `/`; a sample_id
    may. There is no other constructor: every file that names a sample carries `dataset`,
    `sample_id` and (for turns) `turn`, and its key is `SampleKey.of` that row.
    """

    dataset: str
    sample_id: str
    turn: int | None

    def __new__(cls, *args: Any, **kwargs: Any) -> SampleKey:
        raise TypeError("a SampleKey is made from its row: SampleKey.of(row) (dataset, sample_id, turn)")

    @classmethod
    def _make(cls, dataset: str, sample_id: str, turn: int | None) -> SampleKey:
        k = str.__new__(cls, f"{dataset}/{sample_id}" if turn is None else f"{dataset}/{sample_id}#{turn}")
        k.dataset, k.sample_id, k.turn = dataset, sample_id, turn
        return k

    def __reduce__(self) -> tuple[Any, tuple[str, str, int | None]]:
        return (SampleKey._make, (self.dataset, self.sample_id, self.turn))

    @property
    def conversation(self) -> SampleKey:
        """The conversation's key (`dataset/sample_id`): the key itself when it is no turn."""
        return self if self.turn is None else SampleKey._make(self.dataset, self.sample_id, None)

    @classmethod
    def of(cls, row: Any) -> SampleKey:
        """The key of a row: a record, rebuilt line, verdict, mix/index row or `Sample` (a mapping or
        an object with `dataset`, `sample_id` and, for a turn, `turn`; a missing or NaN turn is none)."""
        if isinstance(row, SampleKey):
            return row
        get = row.get if hasattr(row, "get") else (lambda f, d=None: getattr(row, f, d))
        ds, sid, turn = get("dataset"), get("sample_id"), get("turn")
        if ds is None or sid is None:
            raise KeyError(f"a sample key needs `dataset` and `sample_id`; the row has dataset={ds!r}, sample_id={sid!r}")
        return cls._make(str(ds), str(sid), _turn(turn))

    @classmethod
    def of_frame(cls, frame: Any) -> list[SampleKey]:
        """The key of each row of a table (a DataFrame, or a dict of columns, with `dataset`,
        `sample_id` and `turn` when it has one), in row order: `of`'s rule, column by column."""
        turns = frame["turn"] if "turn" in frame else None
        if turns is None:
            return [cls._make(str(d), str(s), None) for d, s in zip(frame["dataset"], frame["sample_id"])]
        return [cls._make(str(d), str(s), _turn(t)) for d, s, t in zip(frame["dataset"], frame["sample_id"], turns)]

    @classmethod
    def codes_of_frame(cls, frame: Any) -> np.ndarray:
        """The keys of a table's rows as one int64 array, in one pass per column: rows i and j get one code
        exactly when `of_frame(frame)[i] == of_frame(frame)[j]` (codes 0, 1, ... in order of first appearance).

        `of`'s parts are coded column by column (the dataset's and the sample_id's text, the turn or none)
        and combined; where two different parts could spell one key (a `/` in a dataset name, a `#` in a
        sample_id beside turns) the table is coded by `of_frame`'s keys themselves."""
        import pandas as pd  # lazily: 01 reads keys one row at a time and needs no pandas

        n = len(frame["dataset"])
        if n == 0:
            return np.zeros(0, np.int64)
        ds, ds_names = pd.factorize(_text_values(frame["dataset"]), use_na_sentinel=False)
        sid, sid_names = pd.factorize(_text_values(frame["sample_id"]), use_na_sentinel=False)
        has_turn, turn = _turn_values(frame["turn"]) if "turn" in frame else (np.zeros(n, bool), np.zeros(n, np.int64))
        if any("/" in str(d) for d in ds_names) or (
                has_turn.any() and pd.Series(sid_names, dtype=object).astype(str).str.contains("#", regex=False).any()):
            return pd.factorize(np.asarray(cls.of_frame(frame), dtype=object))[0].astype(np.int64)
        code = _pair_codes(ds, sid)
        if not has_turn.any():
            return code
        return _pair_codes(_pair_codes(code, has_turn.astype(np.int64)), pd.factorize(turn)[0])


def _text_values(col: Any) -> Any:
    """A key column as values that are equal exactly when their `str` is: integers and booleans as they
    are (one text each), strings as they are, anything else as its text."""
    import pandas as pd

    if isinstance(col, pd.Series) and isinstance(col.dtype, pd.StringDtype) and not col.hasnans:
        return col
    arr = np.asarray(col)
    if arr.dtype.kind in "iub":
        return arr
    arr = arr.astype(object)
    if pd.api.types.infer_dtype(arr, skipna=False) == "string":
        return arr
    return np.asarray([str(x) for x in arr], dtype=object)


def _turn_values(col: Any) -> tuple[np.ndarray, np.ndarray]:
    """(has a turn, the turn or 0) per row of a turn column, by `_turn`'s rule."""
    import pandas as pd

    arr = np.asarray(col)
    if arr.dtype.kind in "iu":
        return np.ones(len(arr), bool), arr.astype(np.int64)
    if arr.dtype.kind == "f":  # NaN is none; int() of a float truncates, as astype does
        has = ~np.isnan(arr)
        return has, np.where(has, arr, 0).astype(np.int64)
    arr = arr.astype(object)
    has = ~pd.isna(arr)
    turn = np.zeros(len(arr), np.int64)
    if has.any():
        turn[has] = [int(t) for t in arr[has]]
    return has, turn


def _pair_codes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One code per distinct (a, b) pair of two code arrays (values 0..n)."""
    import pandas as pd

    a, b = a.astype(np.int64, copy=False), b.astype(np.int64, copy=False)
    if int(b.max()) == 0:  # codes are numbered in order of first appearance: one value adds nothing
        return a
    if int(a.max()) == 0:
        return b
    return pd.factorize(a * (int(b.max()) + 1) + b)[0].astype(np.int64)


def _turn(t: Any) -> int | None:
    """A row's turn: None for none, NaN or pandas' NA (a turn column of a table whose other rows are turns)."""
    if t is None:
        return None
    try:
        return None if t != t else int(t)
    except TypeError:  # pandas.NA: its comparisons are NA, whose truth is refused
        return None


class RunFileError(UserInputError, ValueError):
    """A run file is malformed; the message names file, line and field(s)."""

    def __init__(self, message: str, *, path: Path | None = None, line: int | None = None,
                 fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.path, self.line, self.fields = path, line, fields


# ---------------------------------------------------------------- the supersede rule


def supersede_rule(keys: Sequence[Any], finish_reasons: Sequence[Any]) -> tuple[list[bool], list[bool]]:
    """Per journal line (in journal order): (is the key's record, is a real duplicate's record).

    A key's record is its latest completed line (stop or length), or its latest line when none
    completed; every other line of the key is superseded (a retried error, or an error written
    after a response, never replaces the response). The record is a real duplicate when
    another line of its key completed too (two responses for one sample). `supersede_codes`
    on the keys' codes.
    """
    first: dict[Any, int] = {}
    codes = np.fromiter((first.setdefault(k, len(first)) for k in keys), np.int64)
    is_record, dup = supersede_codes(codes, np.asarray([fr in COMPLETED for fr in finish_reasons], bool))
    return is_record.tolist(), dup.tolist()


def supersede_codes(codes: np.ndarray, completed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The supersede rule on arrays: per line its key's code (`SampleKey.codes_of_frame`) and whether it
    completed (stop or length) -> (is the key's record, is a real duplicate's record), boolean arrays."""
    n = len(codes)
    if n == 0:
        return np.zeros(0, bool), np.zeros(0, bool)
    k = int(codes.max()) + 1
    line = np.arange(n, dtype=np.int64)
    last = np.full(k, -1, np.int64)
    np.maximum.at(last, codes, line)
    last_done = np.full(k, -1, np.int64)
    np.maximum.at(last_done, codes[completed], line[completed])
    chosen = np.where(last_done >= 0, last_done, last)
    is_record = chosen[codes] == line
    done_count = np.bincount(codes[completed], minlength=k)
    return is_record, is_record & (done_count[codes] > 1)


# ---------------------------------------------------------------- files beside the journal


def read_jsonl(path: Path, error: type[RunFileError] = RunFileError) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; a line that is not JSON raises `error` with file:line."""
    data = Path(path).read_bytes()
    lines = data.splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield lineno, orjson.loads(line)
        except orjson.JSONDecodeError as e:
            torn = lineno == len(lines) and not data.endswith(b"\n")
            hint = "; the line is cut off (no newline at the end): was the writer stopped?" if torn else ""
            raise error(f"{path}:{lineno}: not JSON ({e}){hint}", path=path, line=lineno) from None


def _need(obj: dict[str, Any], fields: Iterable[str], path: Path, line: int, error: type[RunFileError]) -> None:
    missing = [f for f in fields if f not in obj]
    if missing:
        raise error(f"{path}:{line}: missing field(s) {', '.join(missing)}", path=path, line=line,
                    fields=tuple(missing))


def read_verdicts(run_dir: str | Path, error: type[RunFileError] = RunFileError) -> dict[SampleKey, dict[str, Any]] | None:
    """03's verdict lines by key, or None when the audit has not run (no `audit/verdicts.jsonl`)."""
    path = Path(run_dir) / "audit" / "verdicts.jsonl"
    if not path.exists():
        return None
    out: dict[SampleKey, dict[str, Any]] = {}
    for lineno, v in read_jsonl(path, error):
        _need(v, ("dataset", "sample_id", "failed"), path, lineno, error)
        out[SampleKey.of(v)] = v
    return out


def read_rebuilt(run_dir: str | Path, datasets: Iterable[str] | None = None,
                 error: type[RunFileError] = RunFileError) -> dict[SampleKey, dict[str, Any]]:
    """02's rebuilt lines by key from `reconstruct/<dataset>.jsonl` (all files when datasets is None)."""
    folder = Path(run_dir) / "reconstruct"
    if datasets is None:
        paths = sorted(p for p in folder.glob("*.jsonl")) if folder.is_dir() else []
    else:
        paths = [p for p in (folder / f"{d}.jsonl" for d in datasets) if p.exists()]
    out: dict[SampleKey, dict[str, Any]] = {}
    for path in paths:
        for lineno, r in read_jsonl(path, error):
            _need(r, ("dataset", "sample_id", "input_ids", "loss_mask"), path, lineno, error)
            ids, mask = r["input_ids"], r["loss_mask"]
            if not isinstance(ids, list) or not isinstance(mask, list):
                raise error(f"{path}:{lineno}: field `input_ids`/`loss_mask` must be lists",
                            path=path, line=lineno, fields=("input_ids", "loss_mask"))
            if len(ids) != len(mask):
                raise error(f"{path}:{lineno}: field `loss_mask` has {len(mask)} entries for {len(ids)} input_ids",
                            path=path, line=lineno, fields=("loss_mask",))
            out[SampleKey.of(r)] = r
    return out


# ---------------------------------------------------------------- samples


@dataclass
class Sample:
    """One training sequence: ids and loss mask, where it came from, and (when kept) its record."""

    dataset: str
    sample_id: str
    source: str
    ids_exact: bool
    finish_reason: str | None
    input_ids: list[int]
    loss_mask: list[int]
    record: dict[str, Any] | None = None
    turn: int | None = None  # the turn of a conversation regenerated turn by turn; None otherwise

    @property
    def key(self) -> SampleKey:
        return SampleKey.of(self)


def resolve(rec: dict[str, Any], rebuilt: dict[SampleKey, dict[str, Any]], *, keep_record: bool = False) -> Sample | None:
    """A record's training sequence: exact prompt_ids+output_ids (mask 0/1), else 02's rebuilt ids, else None.

    `keep_record` keeps the record on the sample (exports need its text; the mix does not, and
    holding every record's text for a large run costs memory).
    """
    key = SampleKey.of(rec)
    p, o = rec.get("prompt_ids"), rec.get("output_ids")
    if p is not None and o is not None:
        ids, mask, exact = list(p) + list(o), [0] * len(p) + [1] * len(o), bool(rec.get("ids_exact", False))
    elif key in rebuilt:
        r = rebuilt[key]
        ids, mask, exact = list(r["input_ids"]), [int(m) for m in r["loss_mask"]], bool(r.get("ids_exact", False))
    else:
        return None
    return Sample(dataset=key.dataset, sample_id=key.sample_id, source=rec.get("source", "?"), ids_exact=exact,
                  finish_reason=rec.get("finish_reason"), input_ids=ids, loss_mask=mask,
                  record=rec if keep_record else None, turn=key.turn)


# ---------------------------------------------------------------- the run


@dataclass
class DatasetLines:
    """One dataset's journal, read once: every line in order, and the rule's verdict on each."""

    name: str
    path: Path
    lines: list[dict[str, Any]]
    is_record: list[bool]
    duplicate: list[bool]
    bad_lines: list[str] = field(default_factory=list)
    torn_tail_bytes: int = 0

    def records(self) -> list[dict[str, Any]]:
        """The record of each key (its latest line), in journal order of those lines."""
        return [r for r, last in zip(self.lines, self.is_record) if last]

    def superseded(self) -> list[dict[str, Any]]:
        """Earlier lines that a later line of the same key replaced."""
        return [r for r, last in zip(self.lines, self.is_record) if not last]


@dataclass
class RunView:
    """A run as every stage sees it: per dataset its journal lines, plus 02's rebuilt ids and 03's verdicts."""

    run_dir: Path
    datasets: dict[str, DatasetLines]
    rebuilt: dict[SampleKey, dict[str, Any]]
    verdicts: dict[SampleKey, dict[str, Any]] | None

    def records(self, datasets: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The record of each key (latest line), dataset by dataset."""
        names = list(self.datasets) if datasets is None else [d for d in datasets if d in self.datasets]
        return [r for d in names for r in self.datasets[d].records()]

    def by_key(self) -> dict[SampleKey, dict[str, Any]]:
        return {SampleKey.of(r): r for r in self.records()}

    def duplicates(self) -> set[SampleKey]:
        """Keys with two completed records (real duplicates)."""
        return {SampleKey.of(r) for d in self.datasets.values() for r, dup in zip(d.lines, d.duplicate) if dup}

    def sample(self, rec: dict[str, Any], *, keep_record: bool = False) -> Sample | None:
        """The training sequence of one record (see `resolve`)."""
        return resolve(rec, self.rebuilt, keep_record=keep_record)

    def samples(self, datasets: Iterable[str] | None = None, *, keep_record: bool = False) -> dict[SampleKey, Sample]:
        """Every completed record's training sequence by key (errors, aborts and records without ids left out)."""
        out: dict[SampleKey, Sample] = {}
        for rec in self.records(datasets):
            if rec.get("finish_reason") not in COMPLETED:
                continue
            s = resolve(rec, self.rebuilt, keep_record=keep_record)
            if s is not None:
                out[s.key] = s
        return out


def dataset_names(run_dir: str | Path) -> list[str]:
    """The datasets that have a journal under `records/`, sorted."""
    return [p.stem for p in sorted((Path(run_dir) / "records").glob("*.jsonl"))]


def read_dataset(run_dir: str | Path, name: str, error: type[RunFileError] = RunFileError) -> DatasetLines:
    """One dataset's journal through the supersede rule (empty when the journal is absent)."""
    path = Path(run_dir) / "records" / f"{name}.jsonl"
    scan = scan_journal(path)
    for r in scan.records:
        if str(r["dataset"]) != name:
            raise error(f"{path}: record {r['sample_id']!r} has dataset {r['dataset']!r}, not {name!r}", path=path,
                        fields=("dataset",))
    latest, dup = supersede_rule([SampleKey.of(r) for r in scan.records],
                                 [r.get("finish_reason") for r in scan.records])
    return DatasetLines(name, path, scan.records, latest, dup, scan.bad_lines, scan.torn_tail_bytes)


def read_run(run_dir: str | Path, datasets: Iterable[str] | None = None, *, error: type[RunFileError] = RunFileError,
             rebuilt: bool = True, verdicts: bool = True) -> RunView:
    """Read a run once: the journals of `datasets` (all when None), 02's rebuilt ids, 03's verdicts."""
    run_dir = Path(run_dir)
    names = dataset_names(run_dir) if datasets is None else list(datasets)
    lines = {n: read_dataset(run_dir, n, error) for n in names}
    return RunView(run_dir, lines, read_rebuilt(run_dir, names, error) if rebuilt else {},
                   read_verdicts(run_dir, error) if verdicts else None)
