"""02's rebuilt ids as 03 reads them at scale: by key, each line's id lists parsed as text when asked for.

A line of `reconstruct/<dataset>.jsonl` holds its ids four times over (`prompt_ids`, `output_ids`,
`input_ids`, `loss_mask`); parsing it whole into Python ints costs most of what 03 spends outside the
tokenizer. `RebuiltIds` indexes a dataset's file the first time one of its keys is asked for: each
line is read once with its four top-level lists cut out (the rest, its key and proof level, parsed by
orjson), the lists' lengths counted from their text; where the line is not written that way (spaces,
signs, anything the count cannot vouch for) the line is parsed whole, as `reader.read_rebuilt` does,
and checked the same way (fields, lists, equal lengths: the same errors, naming file and line). It
keeps per key where its prompt and output lists sit in the file; `get(key)` reads those two byte
ranges and parses them with numpy (`idtable`'s exact text parser). `line(key)` is the whole line
parsed, loss mask included (the inspector's one record).
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from eagle3data.audit.idtable import AuditInputError, _Cuts, _parse_cuts
from eagle3data.core.reader import RunFileError, SampleKey
from eagle3data.core.stream import checked_rebuilt

_CUT = ("prompt_ids", "output_ids", "input_ids", "loss_mask")
_PATTERNS = tuple(b'"' + k.encode() + b'":[' for k in _CUT)


def _count(text: bytes) -> int | None:
    """Elements of a JSON list of non-negative integers written without spaces; None when the text is not one."""
    if not text:
        return 0
    if text.translate(None, b"0123456789,") or text[:1] == b"," or text[-1:] == b"," or b",," in text:
        return None
    return text.count(b",") + 1


class _Where:
    """Where one rebuilt line is: its span, and (fast path) the byte ranges of its prompt and output lists."""

    __slots__ = ("lineno", "start", "end", "prompt", "output", "proof_level")

    def __init__(self, lineno: int, start: int, end: int, prompt: tuple[int, int] | None,
                 output: tuple[int, int] | None, proof_level: Any) -> None:
        self.lineno, self.start, self.end = lineno, start, end
        self.prompt, self.output, self.proof_level = prompt, output, proof_level


class _Lines:
    """One dataset's index, compact: its keys' text to a row, each row's line number, byte span and list ranges
    (-1: read whole) in one int64 array, its sample_id, turn (-1: none) and proof level (shared values). At the
    seeds' 88,000 records this is ~0.3 KB a record, where a `SampleKey` and a `_Where` of tuples each were ~1 KB
    (tracemalloc); a record's `_Where` is made when it is asked for."""

    __slots__ = ("rows", "pos", "sid", "turn", "proof")

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}
        self.pos = array("q")  # lineno, start, end, prompt start, prompt end, output start, output end
        self.sid: list[str] = []
        self.turn = array("q")
        self.proof: list[Any] = []

    def add(self, key: SampleKey, lineno: int, start: int, end: int, prompt: tuple[int, int] | None,
            output: tuple[int, int] | None, proof: Any, shared: dict[Any, Any]) -> None:
        self.rows[str(key)] = len(self.sid)  # a later line of the key replaces an earlier one, as before
        self.pos.extend((lineno, start, end, *(prompt or (-1, -1)), *(output or (-1, -1))))
        self.sid.append(key.sample_id)
        self.turn.append(-1 if key.turn is None else key.turn)
        self.proof.append(shared.setdefault(proof, proof) if isinstance(proof, str) else proof)

    def where(self, key: str) -> _Where:
        i = self.rows[key]
        ln, a, b, p0, p1, o0, o1 = self.pos[7 * i : 7 * i + 7]
        return _Where(ln, a, b, None if p0 < 0 else (p0, p1), None if o0 < 0 else (o0, o1), self.proof[i])

    def keys(self, dataset: str) -> Iterator[SampleKey]:
        for i in self.rows.values():
            t = self.turn[i]
            yield SampleKey._make(dataset, self.sid[i], None if t < 0 else t)


class RebuiltIds(Mapping):
    """02's rebuilt ids by key over a run's `reconstruct/` files: `rebuilt.get(key)` is
    `{"prompt_ids", "output_ids", "proof_level"}` (ids as int64 arrays), read when asked for."""

    def __init__(self, run_dir: str | Path, *, whole: bool = False) -> None:
        self.folder = Path(run_dir) / "reconstruct"
        self.whole = whole  # `get` gives the whole line parsed (`line`)
        self._index: dict[str, _Lines] = {}
        self._files: dict[str, Any] = {}
        nonce = secrets.token_hex(8)
        self._hole, self._hole_json = "\x00" + nonce, b'"\\u0000' + nonce.encode() + b'"'

    def _dataset(self, dataset: str) -> _Lines:
        if dataset not in self._index:
            self._index[dataset] = self._scan(self.folder / f"{dataset}.jsonl")
        return self._index[dataset]

    def _scan(self, path: Path) -> _Lines:
        out, shared = _Lines(), {}
        if not path.exists():
            return out
        off = 0
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                start, off = off, off + len(line)
                if not line.strip():
                    continue
                fast = self._cut(line)
                if fast is None:  # the whole line, as read_rebuilt reads it
                    try:
                        r = orjson.loads(line)
                    except orjson.JSONDecodeError as e:
                        hint = ("; the line is cut off (no newline at the end): was the writer stopped?"
                                if not line.endswith(b"\n") else "")
                        raise AuditInputError(f"{path}:{lineno}: not JSON ({e}){hint}") from None
                    try:
                        checked_rebuilt(r, path, lineno, RunFileError)
                    except RunFileError as e:
                        raise AuditInputError(str(e)) from None
                    out.add(SampleKey.of(r), lineno, start, off, None, None, None, shared)
                    continue
                obj, spans = fast
                out.add(SampleKey.of(obj), lineno, start, off, _shift(spans.get("prompt_ids"), start),
                        _shift(spans.get("output_ids"), start), obj.get("proof_level"), shared)
        return out

    def _cut(self, line: bytes) -> tuple[dict[str, Any], dict[str, tuple[int, int]]] | None:
        """(the line without its four id lists, parsed; each list's byte range in the line), when the cut reading is
        exact: the four are top-level lists of integers, input_ids and loss_mask as long as each other."""
        holes = []
        for k, pat in zip(_CUT, _PATTERNS):
            i = line.find(pat)
            j = line.find(b"]", i + len(pat)) if i >= 0 else -1
            if j < 0:
                return None
            holes.append((i + len(pat), j, k))
        holes.sort()
        if any(a[1] >= b[0] for a, b in zip(holes, holes[1:])):
            return None
        pieces, at = [], 0
        for a, b, _ in holes:
            pieces += [line[at : a - 1], self._hole_json]
            at = b + 1
        pieces.append(line[at:])
        try:
            obj = orjson.loads(b"".join(pieces))
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or any(obj.get(k) != self._hole for k in _CUT) \
                or "dataset" not in obj or "sample_id" not in obj:
            return None
        spans = {k: (a, b) for a, b, k in holes}
        n_ids, n_mask = (_count(line[slice(*spans[k])]) for k in ("input_ids", "loss_mask"))
        if n_ids is None or n_ids != n_mask:  # prompt_ids and output_ids: checked when parsed (`many`)
            return None
        return obj, {k: spans[k] for k in ("prompt_ids", "output_ids")}

    def wholes(self) -> RebuiltIds:
        """The same index, whose `get` gives whole lines (`line`)."""
        other = RebuiltIds(self.folder.parent, whole=True)
        other._index = self._index
        return other

    def _where(self, key: Any) -> _Where:
        key = SampleKey.of(key)
        return self._dataset(key.dataset).where(key)

    def _file(self, key: Any) -> Any:
        ds = SampleKey.of(key).dataset
        if ds not in self._files:
            self._files[ds] = open(self.folder / f"{ds}.jsonl", "rb")  # noqa: SIM115 - held for the run's reads
        return self._files[ds]

    def __getitem__(self, key: Any) -> dict[str, Any]:
        return self.many([key])[0]

    def many(self, keys: list[Any]) -> list[dict[str, Any]]:
        """`self[key]` of each key (KeyError for one 02 did not write), the id lists of all parsed in one numpy pass."""
        wheres = [self._where(k) for k in keys]
        cuts, fast = _Cuts(), []
        for j, (key, w) in enumerate(zip(keys, wheres)):
            if w.prompt is None or self.whole:
                continue
            f = self._file(key)
            for a, b in (w.prompt, w.output):
                f.seek(a)
                cuts.rec.append(len(cuts.text))
                cuts.text.append(f.read(b - a))
            fast.append(j)
        redo: set[int] = set()
        _, counts, vals = _parse_cuts(cuts, redo)
        ends = np.cumsum(counts)
        out: list[dict[str, Any] | None] = [None] * len(keys)
        for k, j in enumerate(fast):
            if 2 * k in redo or 2 * k + 1 in redo:  # a list numpy would not vouch for: the whole line
                continue
            p0, p1, o1 = ends[2 * k] - counts[2 * k], ends[2 * k], ends[2 * k + 1]
            out[j] = {"prompt_ids": vals[p0:p1], "output_ids": vals[p1:o1], "proof_level": wheres[j].proof_level}
        return [o if o is not None else self.line(k) for o, k in zip(out, keys)]

    def line(self, key: Any) -> dict[str, Any]:
        """The key's rebuilt line parsed whole (loss mask and every field)."""
        w = self._where(key)
        f = self._file(key)
        f.seek(w.start)
        return orjson.loads(f.read(w.end - w.start))

    def __contains__(self, key: object) -> bool:
        try:
            self._where(key)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[SampleKey]:
        for ds, d in self._index.items():
            yield from d.keys(ds)

    def __len__(self) -> int:
        return sum(len(d.rows) for d in self._index.values())


def _shift(span: tuple[int, int] | None, by: int) -> tuple[int, int] | None:
    return None if span is None else (span[0] + by, span[1] + by)
