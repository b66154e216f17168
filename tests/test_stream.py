"""core/stream.py reads a run as `reader.read_run` does, line for line, holding only per-line facts:
the same records in the same order, the same supersede verdicts, bad lines and torn tail, and 02's rebuilt
lines by key with the same checks (issue 59)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from runfiles import make_record  # noqa: E402

from eagle3data.core.reader import RunFileError, SampleKey, read_dataset, read_rebuilt, resolve
from eagle3data.core.stream import index_journal, index_rebuilt

FIXTURES = Path(__file__).parent / "fixtures" / "runs"


def _journal(run: Path, name: str, rows: list[dict], tail: bytes = b"") -> None:
    (run / "records").mkdir(parents=True, exist_ok=True)
    (run / "records" / f"{name}.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows) + tail)


def _same(run: Path, name: str, chunk: int) -> None:
    ref = read_dataset(run, name)
    idx = index_journal(run, name)
    assert idx.keys == [SampleKey.of(r) for r in ref.lines]
    assert idx.is_record.tolist() == list(ref.is_record) and idx.duplicate.tolist() == list(ref.duplicate)
    assert idx.bad_lines == ref.bad_lines and idx.torn_tail_bytes == ref.torn_tail_bytes
    got = [r for batch in idx.iter_records(chunk) for r in batch]
    assert got == ref.records()
    assert all(len(b) <= chunk for b in idx.iter_records(chunk))
    for r in ref.records():
        assert idx.record(SampleKey.of(r)) == r


@pytest.mark.parametrize("name", ["b1_glaive", "b4_mixturethoughts", "b7_sharegpt"])
@pytest.mark.parametrize("chunk", [1, 3, 10_000])
def test_fixture_journals_read_alike(name, chunk):
    _same(FIXTURES / "nbval", name, chunk)


def test_supersede_bad_lines_torn_tail_and_turns(tmp_path):
    rows = [make_record("d", 1, finish_reason="error"), make_record("d", 1),  # a retried error: superseded
            make_record("d", 2), make_record("d", 2),  # two completed: a real duplicate
            make_record("d", 3), make_record("d", 3, finish_reason="error"),  # an error after a response
            make_record("d", "x/ü", turn=0), make_record("d", "x/ü", turn=1, content="日本語 ✓")]
    _journal(tmp_path, "d", rows, tail=b'{"dataset": "d", "sample_id": 9')
    with open(tmp_path / "records" / "d.jsonl", "r+b") as f:  # a bad line and a line without a key, mid-file
        data = f.read()
        f.seek(0)
        f.write(data.replace(b"\n", b"\nnot json\n{\"dataset\": \"d\"}\n", 1))
    _same(tmp_path, "d", 2)
    idx = index_journal(tmp_path, "d")
    assert len(idx.bad_lines) == 2 and idx.torn_tail_bytes > 0 and idx.n_records == 5


def test_a_record_of_another_dataset_is_refused_naming_the_file(tmp_path):
    _journal(tmp_path, "d", [make_record("e", 1)])
    with pytest.raises(RunFileError, match=r"d\.jsonl: record 1 has dataset 'e', not 'd'"):
        index_journal(tmp_path, "d")


def test_absent_journal_is_empty(tmp_path):
    idx = index_journal(tmp_path, "none")
    assert len(idx) == 0 and list(idx.iter_records()) == []


def test_rebuilt_index_reads_as_read_rebuilt(tmp_path):
    rec = tmp_path / "reconstruct"
    rec.mkdir()
    lines = [{"dataset": "d", "sample_id": i, "input_ids": [1, 2, i], "loss_mask": [0, 1, 1]} for i in range(5)]
    lines.append({"dataset": "d", "sample_id": 7, "turn": 2, "input_ids": [3], "loss_mask": [1]})
    (rec / "d.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    ref = read_rebuilt(tmp_path, ["d"])
    idx = index_rebuilt(tmp_path, ["d"])
    assert set(idx) == set(ref) and len(idx) == len(ref)
    assert all(idx[k] == ref[k] for k in ref)
    api = {"dataset": "d", "sample_id": 3, "source": "api", "finish_reason": "stop"}
    assert resolve(api, idx).input_ids == resolve(api, ref).input_ids == [1, 2, 3]
    (rec / "d.jsonl").write_bytes(orjson.dumps({"dataset": "d", "sample_id": 1, "input_ids": [1, 2],
                                               "loss_mask": [1]}) + b"\n")
    with pytest.raises(RunFileError, match=r"d\.jsonl:1: field `loss_mask` has 1 entries for 2 input_ids"):
        index_rebuilt(tmp_path, ["d"])


def test_resuming_01_holds_no_ids_or_texts_of_the_journal(tmp_path):
    """01's plan reads a journal it resumes through `scan_journal(keep=PLAN_FIELDS)`: every record's key,
    finish reason and bill, and none of its ids or texts; the file is read in blocks, never whole. A
    journal of 30 MB (200 records of 20,000 ids and a long reply) peaks at a few MB of Python memory,
    where holding it (as the plan did) costs several times its size."""
    import tracemalloc

    from eagle3data.core.records import scan_journal
    from eagle3data.generate.plan import PLAN_FIELDS

    rows = []
    for i in range(200):
        r = make_record("d", i, range(20), range(20_000), finish_reason="length" if i % 3 else "stop")
        r.update(content="é" * 20_000, usage={"prompt_tokens": 20, "completion_tokens": 20_000}, cost_usd=0.01)
        rows.append(r)
    _journal(tmp_path, "d", rows, tail=b'{"dataset": "d", "sample_id": 9')
    path = tmp_path / "records" / "d.jsonl"
    size = path.stat().st_size
    tracemalloc.start()
    scan = scan_journal(path, repair=True, keep=PLAN_FIELDS)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [r["sample_id"] for r in scan.records] == [r["sample_id"] for r in rows]
    assert all(set(r) <= set(PLAN_FIELDS) and "output_ids" not in r and "content" not in r for r in scan.records)
    assert scan.records[1]["usage"]["completion_tokens"] == 20_000 and scan.records[0]["finish_reason"] == "stop"
    assert scan.torn_tail_bytes and path.stat().st_size == size - scan.torn_tail_bytes  # repaired
    assert size > 25e6 and peak < size / 8, (peak, size)
    # without `keep` the same journal reads in full, as the stages that want every field read it
    full = scan_journal(path)
    assert full.records == rows


def test_03s_rebuilt_index_reads_as_read_rebuilt_and_holds_no_key_object_per_line(tmp_path):
    """03's `RebuiltIds` (audit/rebuilt.py) keeps per line its key's text, one row of positions and shared proof
    levels; what it gives is `read_rebuilt`'s: the same keys (as SampleKeys, their parts kept: a turn, a `/` in
    a sample_id), the later of two lines of a key, the prompt and output ids of lines read by their cut lists and
    of lines read whole (spaces in a list), the whole line with its mask."""
    import json

    from eagle3data.audit.rebuilt import RebuiltIds

    rec = tmp_path / "reconstruct"
    rec.mkdir()

    def line(sid, p, o, turn=None, proof="text", spaced=False):
        r = {"dataset": "d", "sample_id": sid, "prompt_ids": p, "output_ids": o, "input_ids": p + o,
             "loss_mask": [0] * len(p) + [1] * len(o), "proof_level": proof}
        if turn is not None:
            r["turn"] = turn
        return json.dumps(r).encode() if spaced else orjson.dumps(r)

    rows = [line(1, [1, 2], [3]), line("a/b", [4], [5, 6], proof="engine"), line("c", [7], [8], turn=0),
            line("c", [7, 8, 9], [10], turn=1, spaced=True), line(2, [11], [12, 13], spaced=True),
            line(1, [1, 2], [30, 31])]  # d/1 again: the later line is the key's
    (rec / "d.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    ref = read_rebuilt(tmp_path, ["d"])
    idx = RebuiltIds(tmp_path)
    k1 = next(k for k in ref if k == "d/1")
    assert k1 in idx and SampleKey.of({"dataset": "d", "sample_id": 9}) not in idx  # the first ask indexes it
    keys = list(idx)
    assert sorted(keys) == sorted(ref) and len(idx) == len(ref) == 5
    assert {(k.sample_id, k.turn) for k in keys} == {("1", None), ("a/b", None), ("c", 0), ("c", 1), ("2", None)}
    assert all(type(k).__name__ == "SampleKey" for k in keys)
    got = idx.many(sorted(ref))
    for k, g in zip(sorted(ref), got):
        assert list(g["prompt_ids"]) == ref[k]["prompt_ids"] and list(g["output_ids"]) == ref[k]["output_ids"], k
        assert g["proof_level"] == ref[k]["proof_level"]
        assert idx.line(k)["loss_mask"] == ref[k]["loss_mask"]
    assert list(idx[k1]["output_ids"]) == [30, 31]
    assert idx._index["d"].proof[0] is idx._index["d"].proof[2]  # one shared value per proof level
