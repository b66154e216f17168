"""Run files for tests: a hand-made record, a JSONL writer, and the ledger invariant (shared by several test files)."""

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


def assert_ledger_adds_up(run_dir: Path) -> dict:
    """The run's ledger.json, after checking every planned sample is done, failed, skipped or cancelled once."""
    from eagle3data.ledger import read_ledger

    led = read_ledger(run_dir)
    for name, d in led["datasets"].items():
        assert d["in_flight"] == 0, name
        assert d["done"] + d["errors"] + d["skipped"] + d["cancelled"] == d["planned"], (name, d)
        assert len(d["skipped_ids"]) == d["skipped"] and len(d["cancelled_ids"]) == d["cancelled"]
    return led
