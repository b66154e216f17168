"""Hand-made run files for tests: a record dict and a JSONL writer (shared by mix and sequences tests)."""

from __future__ import annotations

from pathlib import Path

import orjson


def make_record(ds: str, sid, prompt=(1, 2, 3), output=(4, 5, 2), **kw) -> dict:
    """A journal record; `output=None` makes an API-style record without output ids."""
    r = {"dataset": ds, "sample_id": sid, "source": "local", "model": "m", "profile": "smollm2",
         "prompt_ids": list(prompt), "output_ids": None if output is None else list(output),
         "ids_exact": output is not None, "finish_reason": "stop"}
    r.update(kw)
    return r


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write rows as a JSONL file, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
