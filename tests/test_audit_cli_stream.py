"""`python -m eagle3data audit` streams: the stage's chunked path, the command's outputs as a whole read gave them.

The reference is the in-memory audit the command ran before (issue 59): every journal read whole
(`read_journal`), joined (`concat_tables`), 02's rebuilt ids merged (`merge_reconstruct`) and audited as one
table (`audit_table`). On the fixture runs, on a run with a torn tail, superseded lines, a key completed twice,
API records with 02's ids and turns (test_audit_stream's Qwen3 run, its bad line taken out), and on a .parquet
read by record batches, the command writes the reference's verdicts.jsonl and summary.json (the time taken
aside), prints its lines and exits with its status, whatever the chunk. What it refuses it refuses as the
whole read did (unreadable lines named file:line, no records, no one profile), also when the refusal lies in a
later chunk, and writes nothing then. Its peak of traced memory does not grow with the number of records.
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3data.audit.command import audit_cli
from eagle3data.audit.idtable import AuditInputError, read_journal
from eagle3data.audit.run import audit_table
from eagle3data.audit.runtable import concat_tables, merge_reconstruct
from eagle3data.cli import main as cli_main
from eagle3data.core.models import load_tokenizer
from eagle3data.core.profiles import get_profile
from qwen3_vocab import qwen3_tokenizer_dir
from runfiles import write_jsonl
from synthetic import synthetic_records
from test_audit_stream import qwen_run  # noqa: F401  (the fixture: a Qwen3 run holding every cross-chunk case)

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "tests" / "fixtures" / "runs"


def _paths(records: Path) -> tuple[list[Path], Path]:
    """The files the command reads for RECORDS, and the run folder it merges 02's ids from (as `audit_cli`)."""
    if records.is_dir():
        return sorted(records.glob("*.jsonl")), records.parent
    return [records], records.parent.parent


def _reference(records: Path, profile: str, tokenizer: str | None, out: Path) -> dict:
    """The in-memory audit the command ran before it streamed, written to `out`: its summary."""
    paths, run_dir = _paths(records)
    table = merge_reconstruct(concat_tables([read_journal(p, source_fields=True) for p in paths]), run_dir)
    prof = get_profile(profile)
    tok = None if tokenizer is None else load_tokenizer(tokenizer, trust_remote_code=True, profile=prof)
    result = audit_table(table, prof, tokenizer=tok)
    result.write(out)
    return result.summary()


def _written(out: Path) -> tuple[bytes, dict]:
    summary = orjson.loads((out / "summary.json").read_bytes())
    summary.pop("seconds")
    return (out / "verdicts.jsonl").read_bytes(), summary


def _said(s: dict, profile: str, out: Path) -> tuple[str, str, list[str], str]:
    """What the command prints for the summary `s`: its first line's start and end (the time between), the lines after
    the tokenizer's, its last line."""
    middle = []
    if s["superseded_lines"]:
        middle.append(f"superseded: {s['superseded_lines']} earlier journal line(s) replaced by a later line of the "
                      "same sample (a retried error): not audited")
    if s["torn_tail_bytes"]:
        middle.append(f"torn tail: {s['torn_tail_bytes']} bytes after the last complete line (a write cut off): "
                      "ignored")
    for name, c in s["checks"].items():
        if c["failed"]:
            middle.append(f"  {name}: {c['failed']}/{c['applicable']} failed")
        if c["flagged"]:
            middle.append(f"  {name}: {c['flagged']}/{c['applicable']} flagged (audit.flag_only: kept, not failed)")
    return (f"audited {s['records']} records ({s['output_tokens']} output tokens, profile {profile}) in ",
            f" s: {s['records_failed']} failed, {s['records_truncated']} truncated", middle,
            f"wrote {out / 'verdicts.jsonl'} and {out / 'summary.json'}")


def _same_as_reference(records: Path, profile: str, tokenizer: str | None, tmp_path: Path, capsys,
                       chunks: tuple[int, ...] = (1, 2)) -> dict:
    """The command (through `cli.main`, and `audit_cli` at each chunk) writes, prints and exits as the reference."""
    ref = _reference(records, profile, tokenizer, tmp_path / "ref")
    expected = _written(tmp_path / "ref")
    args = ["audit", str(records), "--out", str(tmp_path / "cli")] + (["--tokenizer", tokenizer] if tokenizer else [])
    capsys.readouterr()
    assert cli_main(args) == (1 if ref["records_failed"] else 0)
    said = capsys.readouterr().out.splitlines()
    assert _written(tmp_path / "cli") == expected
    start, end, middle, last = _said(ref, profile, tmp_path / "cli")
    assert said[0].startswith(start) and said[0].endswith(end), said[0]
    if tokenizer:
        assert said[1] == f"tokenizer checks: run with tokenizer {tokenizer}"
    else:
        assert said[1].startswith("tokenizer checks: NOT RUN: no recorded params of the run"), said[1]
    assert said[2:-1] == middle and said[-1] == last
    for chunk in chunks:
        out = tmp_path / f"chunk{chunk}"
        rc = audit_cli(str(records), profile=None, out=str(out), tokenizer=tokenizer, allow_failed=True,
                       chunk_records=chunk)
        assert rc == 0 and _written(out) == expected, chunk
    return ref


@pytest.mark.parametrize("run, profile, tokenizer", [
    ("nbval", "smollm2", None), ("nbval", "smollm2", "embedded:smollm2"),
    ("kimi_synthetic", "kimi-k2.5", None), ("kimi_synthetic", "kimi-k2.5", "synthetic:kimi-k2.5"),
])
def test_fixture_runs_audit_as_the_whole_read(run, profile, tokenizer, tmp_path, capsys):
    """A run's records/ folder and one of its journals alone: the reference's files, lines and status."""
    records = RUNS / run / "records"
    ref = _same_as_reference(records, profile, tokenizer, tmp_path / "folder", capsys)
    lines = sum(1 for p in records.glob("*.jsonl") for ln in p.read_bytes().splitlines() if ln.strip())
    assert ref["records"] > 0 and ref["records"] + ref["superseded_lines"] == lines  # every line read
    one = sorted(records.glob("*.jsonl"))[-1]
    _same_as_reference(one, profile, tokenizer, tmp_path / "one", capsys)


def test_a_run_with_torn_tail_superseded_lines_and_rebuilt_ids(qwen_run, tmp_path, capsys):  # noqa: F811
    """Every case that spans chunks (turns, a retried error, a key completed twice, an output equal to another
    prompt's, API records with 02's ids and one without, a torn tail), with the Qwen3 tokenizer's text checks."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(qwen_run, run)
    a = run / "records" / "a.jsonl"
    a.write_bytes(a.read_bytes().replace(b"{not json\n", b""))  # the command refuses a bad line (below)
    ref = _same_as_reference(run / "records", "qwen3", str(qwen3_tokenizer_dir()), tmp_path / "out", capsys,
                             chunks=(1, 2, 3))
    assert ref["superseded_lines"] == 2 and ref["torn_tail_bytes"] > 0 and ref["ids_from"]["reconstruct"] == 3
    assert ref["checks"]["dataset.distinct_outputs"]["failed"] == 2 and ref["checks"]["prompt.on_policy"]["failed"] == 1
    assert ref["checks"]["text.roundtrip"]["flagged"] >= 1 and ref["records_failed"] > 0
    # one journal given alone, its run's reconstruct/ two folders up: c's API records get 02's ids
    ref = _same_as_reference(run / "records" / "c.jsonl", "qwen3", None, tmp_path / "c", capsys)
    assert ref["ids_from"] == {"reconstruct": 3, "none": 1}


def test_a_parquet_is_read_by_record_batches(tmp_path, capsys):
    """A .parquet (messages and tools as JSON text, row groups of 3) in batches of 1 and 2 rows: the whole read's
    files, the lines numbered as rows; a retried error superseded across batches."""
    recs = synthetic_records(7, seed=11, max_output=300, tool_share=0.5, truncated_share=0.3)
    rows = [dict(recs[3], finish_reason="error", output_ids=None)] + recs  # an error, then its retry
    rows = [{k: orjson.dumps(v).decode() if k in ("messages", "tools") else v for k, v in r.items()} for r in rows]
    path = tmp_path / "records.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    ref = _same_as_reference(path, "kimi-k2.5", "synthetic:kimi-k2.5", tmp_path / "out", capsys)
    assert ref["records"] == 7 and ref["superseded"] == [
        {"dataset": "synthetic", "sample_id": 3, "finish_reason": "error", "file": str(path), "line": 1,
         "record_line": 5}]


def _refused(records: Path, out: Path, chunk: int = 1, profile: str | None = None) -> str:
    with pytest.raises(AuditInputError) as e:
        audit_cli(str(records), profile=profile, out=str(out), chunk_records=chunk)
    assert not out.exists()  # nothing written
    return str(e.value)


def test_refusals_in_a_later_chunk_are_the_whole_reads(tmp_path):
    recs = synthetic_records(5, seed=2, max_output=200)
    folder = tmp_path / "journals"
    lines = [orjson.dumps(r) for r in recs]
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b"\n".join(lines[:3] + [b"{not json"] + lines[3:]) + b"\n")
    (folder / "b.jsonl").write_bytes(lines[0] + b"\n[1, 2]\n" + b"\n".join(lines[1:]) + b"\n")
    whole = concat_tables([read_journal(p) for p in sorted(folder.glob("*.jsonl"))]).bad_lines
    assert len(whole) == 2
    for chunk in (1, 2, 512):
        said = _refused(folder, tmp_path / "o", chunk)
        assert said == "unreadable lines:\n  " + "\n  ".join(whole), said
        assert f"{folder / 'a.jsonl'}:4: not JSON" in said
        assert f"{folder / 'b.jsonl'}:2: line is not a JSON object" in said
    # the records name two profiles, the second from the last line on (a later chunk): pass --profile
    (folder / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (folder / "b.jsonl").write_bytes(orjson.dumps(dict(recs[0], sample_id=99, profile="qwen3")) + b"\n")
    for chunk in (1, 512):
        assert _refused(folder, tmp_path / "o", chunk) == \
            f"{folder}: the records name profiles kimi-k2.5, qwen3: pass --profile NAME"
    assert audit_cli(str(folder), profile="kimi-k2.5", out=str(tmp_path / "given"), chunk_records=1,
                     allow_failed=True) == 0  # named: the records' own names are not asked
    # none names one (the first lines name none, a later one does: that one is the profile)
    (folder / "b.jsonl").unlink()
    (folder / "a.jsonl").write_bytes(b"\n".join(orjson.dumps(dict(r, profile=None)) for r in recs) + b"\n")
    assert _refused(folder, tmp_path / "o") == f"{folder}: the records name no profile: pass --profile NAME"
    (folder / "a.jsonl").write_bytes(b"\n".join([orjson.dumps(dict(r, profile=None)) for r in recs[:3]]
                                                + lines[3:]) + b"\n")
    assert audit_cli(str(folder), profile=None, out=str(tmp_path / "later"), chunk_records=1, allow_failed=True) == 0
    assert orjson.loads((tmp_path / "later" / "summary.json").read_bytes())["profile"] == "kimi-k2.5"
    # no records: an empty journal, with or without --profile
    (folder / "a.jsonl").write_bytes(b"")
    assert _refused(folder, tmp_path / "o") == f"{folder}: no records"
    assert _refused(folder, tmp_path / "o", profile="kimi-k2.5") == f"{folder}: no records"


def test_a_bad_line_is_one_error_line_and_exit_2(tmp_path):
    """Through `python -m eagle3data audit`: the line naming file:line on stderr, status 2, nothing written."""
    recs = synthetic_records(3, seed=4, max_output=200)
    p = tmp_path / "journal.jsonl"
    p.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs[:2]) + b'{"dataset": "synthetic", "sample_i\n'
                  + orjson.dumps(recs[2]) + b"\n")
    proc = subprocess.run([sys.executable, "-m", "eagle3data", "audit", str(p), "--out", str(tmp_path / "o")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: unreadable lines: {p}:3: not JSON"), proc.stderr
    assert proc.stdout == "" and not (tmp_path / "o").exists()


def _peak(records: Path, out: Path, chunk: int) -> int:
    tracemalloc.start()
    try:
        audit_cli(str(records), profile=None, out=str(out), chunk_records=chunk, allow_failed=True)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_set_by_the_chunk_not_the_input(tmp_path, capsys):
    """Peak traced memory (Python objects and numpy buffers) of the command at N and 4N records, 4 lines a chunk:
    within 1.3x, while the input's ids grow 4x (the whole read's peak grows with them)."""
    recs = synthetic_records(60, seed=5, min_output=4000, max_output=6000, tool_share=0.3)
    for name, k in (("n", 1), ("n4", 4)):
        write_jsonl(tmp_path / name / "records" / "synthetic.jsonl",
                    [dict(r, sample_id=f"{j}-{r['sample_id']}") for j in range(k) for r in recs])
    _peak(tmp_path / "n" / "records", tmp_path / "o0", 4)  # once first: what a first audit allocates once (imports)
    small = _peak(tmp_path / "n" / "records", tmp_path / "o1", 4)
    large = _peak(tmp_path / "n4" / "records", tmp_path / "o2", 4)
    tracemalloc.start()
    try:
        _reference(tmp_path / "n4" / "records", "kimi-k2.5", None, tmp_path / "o3")
        whole = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"peak traced memory: {small / 2**20:.2f} MiB at 60 records, {large / 2**20:.2f} MiB at 240 (4 lines a "
          f"chunk); the whole read at 240: {whole / 2**20:.2f} MiB")
    assert large < 1.3 * small, (small, large)
    assert whole > 3 * large, (whole, large)
    assert _written(tmp_path / "o2") == _written(tmp_path / "o3")
