"""A run's training sequences, read once for every consumer (04's mix, 05's exports).

One rule, shared: per (dataset, sample_id) the LAST journaled record counts (a retried error is
replaced by its retry); its sequence is the exact `prompt_ids + output_ids` with loss_mask 0 on
the prompt and 1 on the output when the record has both, else 02's rebuilt `input_ids` /
`loss_mask` from `reconstruct/<dataset>.jsonl`, else none. 03's verdicts come from
`audit/verdicts.jsonl`. Malformed input raises `RunFileError` naming file, line and field(s).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import orjson

from .records import read_records, record_key

Key = tuple[str, str]  # (dataset, sample_id as text): records.record_key


class RunFileError(ValueError):
    """A run file is malformed; the message names file, line and field(s).

    Subclasses may override `missing` to word a missing-field message their own way.
    """

    def __init__(self, message: str, *, path: Path | None = None, line: int | None = None,
                 fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.path, self.line, self.fields = path, line, fields

    @classmethod
    def missing(cls, path: Path, line: int, fields: list[str]) -> RunFileError:
        """The error for a line that lacks `fields`."""
        return cls(f"{path}:{line}: missing field(s) {', '.join(fields)}", path=path, line=line, fields=tuple(fields))


def sample_key(dataset: str, sample_id: Any) -> str:
    """The stable text key of a sample across stages: `dataset/sample_id`."""
    return f"{dataset}/{sample_id}"


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

    @property
    def key(self) -> str:
        """`dataset/sample_id`: the text key of a sample across stages (mix, hidden shards)."""
        return sample_key(self.dataset, self.sample_id)

    @property
    def id(self) -> str:
        """`dataset:sample_id`: the id trainer exports carry."""
        return f"{self.dataset}:{self.sample_id}"


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
            hint = "; torn last line (no newline): was the writer cut off?" if torn else ""
            raise error(f"{path}:{lineno}: not JSON ({e}){hint}", path=path, line=lineno) from None


def _need(obj: dict[str, Any], fields: Iterable[str], path: Path, line: int, error: type[RunFileError]) -> None:
    missing = [f for f in fields if f not in obj]
    if missing:
        raise error.missing(path, line, missing)


def read_verdicts(run_dir: str | Path, error: type[RunFileError] = RunFileError) -> dict[Key, dict[str, Any]] | None:
    """03's verdict lines by (dataset, sample_id), or None when the audit has not run (no `audit/verdicts.jsonl`)."""
    path = Path(run_dir) / "audit" / "verdicts.jsonl"
    if not path.exists():
        return None
    out: dict[Key, dict[str, Any]] = {}
    for lineno, v in read_jsonl(path, error):
        _need(v, ("dataset", "sample_id", "failed"), path, lineno, error)
        out[record_key(v)] = v
    return out


def read_rebuilt(run_dir: str | Path, datasets: Iterable[str] | None = None,
                 error: type[RunFileError] = RunFileError) -> dict[Key, dict[str, Any]]:
    """02's rebuilt lines by (dataset, sample_id) from `reconstruct/<dataset>.jsonl` (all files when datasets is None)."""
    folder = Path(run_dir) / "reconstruct"
    if datasets is None:
        paths = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    else:
        paths = [p for p in (folder / f"{d}.jsonl" for d in datasets) if p.exists()]
    out: dict[Key, dict[str, Any]] = {}
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
            out[record_key(r)] = r
    return out


def journal(run_dir: str | Path, dataset: str) -> list[dict[str, Any]]:
    """Every complete record of `records/<dataset>.jsonl` in journal order (empty when absent)."""
    path = Path(run_dir) / "records" / f"{dataset}.jsonl"
    return read_records(path) if path.exists() else []


def split_latest(records: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(last journaled record per key, in order of each key's first line; the earlier records they replace)."""
    latest: dict[Key, dict[str, Any]] = {}
    superseded: list[dict[str, Any]] = []
    for rec in records:
        key = record_key(rec)
        if key in latest:
            superseded.append(latest[key])
        latest[key] = rec
    return list(latest.values()), superseded


def latest_records(run_dir: str | Path, datasets: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """The last journaled record per (dataset, sample_id) of the given datasets' journals (all when None)."""
    run_dir = Path(run_dir)
    if datasets is None:
        datasets = [p.stem for p in sorted((run_dir / "records").glob("*.jsonl"))]
    return split_latest(rec for d in datasets for rec in journal(run_dir, d))[0]


def resolve(rec: dict[str, Any], rebuilt: dict[Key, dict[str, Any]], *, keep_record: bool = False) -> Sample | None:
    """A record's training sequence: exact prompt_ids+output_ids (mask 0/1), else 02's rebuilt ids, else None.

    `keep_record` keeps the record on the sample (exports need its text; the mix does not, and
    holding every record's text for a large run costs memory).
    """
    key = record_key(rec)
    p, o = rec.get("prompt_ids"), rec.get("output_ids")
    if p is not None and o is not None:
        ids, mask, exact = list(p) + list(o), [0] * len(p) + [1] * len(o), bool(rec.get("ids_exact", False))
    elif key in rebuilt:
        r = rebuilt[key]
        ids, mask, exact = list(r["input_ids"]), [int(m) for m in r["loss_mask"]], bool(r.get("ids_exact", False))
    else:
        return None
    return Sample(dataset=key[0], sample_id=key[1], source=rec.get("source", "?"), ids_exact=exact,
                  finish_reason=rec.get("finish_reason"), input_ids=ids, loss_mask=mask, record=rec if keep_record else None)
