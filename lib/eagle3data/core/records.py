"""Records: the contract between stages, and the append-only journal that holds them.

`outputs/<run>/records/<dataset>.jsonl` holds one JSON object per line (schema below). It
is appended to as each response completes and never rewritten; later stages write their
own files beside it. Resume is keyed by `reader.SampleKey.of(record)`, never by line counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import orjson
from pydantic import BaseModel, ConfigDict

Source = Literal["local", "sglang", "vllm", "api"]
FinishReason = Literal["stop", "length", "abort", "error"]


class Usage(BaseModel):
    """Token counts as reported by the engine or billed by the API."""

    model_config = ConfigDict(extra="allow")
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None


class Record(BaseModel):
    """One response to one prompt. Fields that a backend cannot know are null."""

    model_config = ConfigDict(extra="allow")

    dataset: str
    sample_id: int | str
    source: Source
    model: str
    profile: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    ids_exact: bool = False
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: FinishReason
    native_finish_reason: str | None = None
    usage: Usage = Usage()
    cost_usd: float | None = None
    provider: str | None = None
    generation_id: str | None = None
    sampling: dict[str, Any] | None = None
    latency_s: float | None = None
    error: str | None = None
    created_at: float | None = None


@dataclass
class JournalScan:
    """What reading a journal found: the records, and what had to be cut or was skipped."""

    records: list[dict[str, Any]] = field(default_factory=list)
    torn_tail_bytes: int = 0
    bad_lines: list[str] = field(default_factory=list)


KEY_FIELDS = ("dataset", "sample_id", "finish_reason")


def record_object(line: bytes | memoryview, where: str) -> tuple[dict[str, Any] | None, str | None]:
    """One journal line read whole: (the record, None), or (None, `where: why` it is no record: not JSON, not
    an object, a key field missing). The one rule of what a record line is: `JournalLines` and 03's readers
    (`audit/idtable`) both ask it."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        return None, f"{where}: not JSON ({e})"
    if not isinstance(obj, dict):
        return None, f"{where}: line is not a JSON object"
    missing = [k for k in KEY_FIELDS if k not in obj]
    if missing:
        return None, f"{where}: missing field(s) {', '.join(missing)}"
    return obj, None


class JournalLines:
    """The one rule for which lines of a journal are records, applied in one forward pass.

    Iterating yields `(line number, byte offset, line with its newline, parsed object)` for each record
    line: JSON, an object, with `dataset`, `sample_id` and `finish_reason`, ended by its newline. The
    others are collected as met: `bad_lines` (file:line and why; a blank line is skipped silently), and
    `torn_tail_bytes`, a last line without its newline (a write cut by a crash; never parsed). The file
    is read in blocks, never whole: `scan_journal` and `stream.index_journal` both read through it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.bad_lines: list[str] = []
        self.torn_tail_bytes = 0

    def __iter__(self) -> Iterator[tuple[int, int, bytes, dict[str, Any]]]:
        if not self.path.exists():
            return
        off = 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                start, off = off, off + len(line)
                if not line.endswith(b"\n"):
                    self.torn_tail_bytes = len(line)
                    return
                if not line.strip():
                    continue
                obj, why = record_object(line, f"{self.path}:{lineno}")
                if obj is None:
                    self.bad_lines.append(why)
                    continue
                yield lineno, start, line, obj


def scan_journal(path: str | Path, *, repair: bool = False, keep: Iterable[str] | None = None) -> JournalScan:
    """Read a journal's records (`JournalLines`' rule), detecting a torn last line (a write cut by a crash).

    A last line without its newline is incomplete by construction (every record is written as one
    `line + "\\n"`); with `repair=True` it is cut off the file so appends resume on a clean boundary.
    Unparseable complete lines are reported in `bad_lines` and skipped. `keep` names the only fields
    kept of each record (01's plan keeps its keys, finish reasons and bills, not the ids and texts of a
    whole run); None keeps every field.
    """
    lines = JournalLines(path)
    scan = JournalScan()
    fields = None if keep is None else tuple(keep)
    for _lineno, _off, _line, obj in lines:
        scan.records.append(obj if fields is None else {k: obj[k] for k in fields if k in obj})
    scan.bad_lines, scan.torn_tail_bytes = lines.bad_lines, lines.torn_tail_bytes
    if repair and scan.torn_tail_bytes:
        with open(lines.path, "r+b") as f:
            f.truncate(lines.path.stat().st_size - scan.torn_tail_bytes)
            f.flush()
            os.fsync(f.fileno())
    return scan


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a journal, as dicts (a torn tail is ignored, not repaired)."""
    return scan_journal(path).records


class Journal:
    """Append-only JSONL writer: one `write` = one complete line, flushed at once.

    Each record is serialised first and written with a single `write` of `line + "\\n"`, so a
    crash leaves at most one torn line at the end, which `scan_journal(repair=True)` cuts.
    `fsync=True` also forces each line to disk (survives power loss, costs throughput).
    """

    def __init__(self, path: str | Path, *, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._f = open(self.path, "ab", buffering=0)

    def write(self, record: dict[str, Any] | Record) -> None:
        if isinstance(record, Record):
            record = record.model_dump(mode="json")
        line = orjson.dumps(record) + b"\n"
        self._f.write(line)
        if self._fsync:
            os.fsync(self._f.fileno())

    def write_many(self, records: Iterable[dict[str, Any] | Record]) -> None:
        for r in records:
            self.write(r)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
