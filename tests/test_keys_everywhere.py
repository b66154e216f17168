"""One key for one record in every file a run writes: `SampleKey.of(record)`.

Every record kind (exact, API, a turn, an API turn, a retried error then its success) through 02 → 03
→ 04 → 05: the key of each line of `reconstruct/`, `audit/verdicts.jsonl`, `hidden/mix.parquet`,
`hidden/index.parquet` and every export file is the key of the record it came from, made from the
row's own fields (dataset, sample_id, turn) — never a spelling that drops the turn.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from eagle3data.core.reader import SampleKey
from test_one_truth import _api, _error, _exact, _run


@pytest.fixture(scope="module")
def model(ci_run):
    from eagle3data.core.models import model_for

    return model_for(ci_run)


def _turns(rows: list[dict]) -> list[dict]:
    """The same records as turns 0, 1, ... of one conversation (ids and text unchanged)."""
    return [{**r, "sample_id": "conv/1", "turn": t} for t, r in enumerate(rows)]


@pytest.fixture(scope="module")
def journal(smollm2_tokenizer):
    tok = smollm2_tokenizer
    retried = _exact(tok, "b1_glaive", 7, "Retried and answered.")
    return {
        "b1_glaive": [_error(retried), _exact(tok, "b1_glaive", 1, "An exact answer."), retried],
        "b5_openthoughts": [_api(tok, "b5_openthoughts", 10, "An answer from the API.")],
        "b6_ultrachat": _turns([_exact(tok, "b6_ultrachat", 1, "First turn."),
                                _exact(tok, "b6_ultrachat", 2, "Second turn.")]),
        "b7_sharegpt": _turns([_api(tok, "b7_sharegpt", 1, "An API turn."),
                               _api(tok, "b7_sharegpt", 2, "Another API turn.")]),
    }


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [orjson.loads(ln) for ln in path.read_bytes().splitlines() if ln.strip()]
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pandas().to_dict("records")
    return []


def test_every_file_keys_a_record_by_sample_key_of_the_record(journal, smollm2_tokenizer, model, tmp_path,
                                                             monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    names = list(journal)
    p, audit, ext, exp = _run(tmp_path, journal, smollm2_tokenizer, model, **{
        "datasets": [{"name": n, "path": f"builtin:{n}"} for n in names], "hidden.include_failed": True,
        "hidden.min_proof_level": "text", "export.formats": ["specforge", "speculators"]})
    records = {SampleKey.of(r): r for rows in journal.values() for r in rows if r["finish_reason"] == "stop"}
    assert {"b1_glaive/7", "b6_ultrachat/conv/1#1", "b7_sharegpt/conv/1#0"} <= set(records)
    api = {k for k, r in records.items() if r["output_ids"] is None}
    assert api == {"b5_openthoughts/10", "b7_sharegpt/conv/1#0", "b7_sharegpt/conv/1#1"}

    rebuilt = [ln for n in names if (f := p.run_dir / "reconstruct" / f"{n}.jsonl").exists() for ln in _rows(f)]
    assert {SampleKey.of(ln) for ln in rebuilt} == api
    verdicts = _rows(p.run_dir / "audit" / "verdicts.jsonl")
    assert {SampleKey.of(v) for v in verdicts} == set(records) and len(verdicts) == len(records)
    api_verdicts = {SampleKey.of(v): v for v in verdicts if SampleKey.of(v) in api}
    assert all("record.has_ids" not in v["failed"] for v in api_verdicts.values())  # 03 found 02's ids

    for name in ("mix.parquet", "index.parquet"):
        rows = _rows(ext.hidden_dir / name)
        assert [r["key"] for r in rows] == [str(SampleKey.of(r)) for r in rows], name
        assert {r["key"] for r in rows} == set(records), name  # every kind reached the mix and the store

    checked = 0
    for path in sorted((p.run_dir / "export").rglob("*")):
        for row in _rows(path):
            if "id" in row and "dataset" in row:  # a token-level row: its id is the key of its own fields
                assert row["id"] == str(SampleKey.of(row)), path
            if "id" in row:
                assert row["id"] in records, (path, row["id"])
                checked += 1
    assert checked >= 2 * len(records)
    for fmt in ("specforge", "speculators"):
        man = orjson.loads((p.run_dir / "export" / fmt / "handoff.json").read_bytes()) \
            if (p.run_dir / "export" / fmt / "handoff.json").exists() else None
        if man is not None and "keys" in man:
            assert set(man["keys"]) == set(records), fmt
