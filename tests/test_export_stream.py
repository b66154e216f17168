"""04's mix and 05's hand-offs stream (issue 59): a chunk setting, not the run, sets their memory.

(1) On a hand-made run with every kind of line the mix sees (turn records, tool calls, unicode text, a retried
error, a real duplicate, duplicate ids, a failed audit, a rebuilt API record, one 02 never rebuilt), the mix and
every file of both online hand-offs made one row at a time equal those made with one chunk holding everything,
from a mix built by 05 and from 04's written mix. (2) Python's allocations while the mix is built and both
online hand-offs written do not grow with the number of records (tracemalloc, a small chunk setting).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import orjson
import pytest

from eagle3data.core.params import load_params
from eagle3data.core.params.export import ONLINE_FORMATS
from eagle3data.export.run import run_export, select_samples
from eagle3data.hidden.mix import build_mix, read_mix
from runfiles import make_record, write_jsonl

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("speculators")

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look it up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def _params(root: Path, name: str, chunk: int, **over):
    return load_params(REPO / "params" / "ci.yaml", {
        "output_root": str(root), "run_name": name, "hidden.enabled": False, "export.formats": list(ONLINE_FORMATS),
        "export.chunk_rows": chunk, "hidden.mix_chunk_rows": chunk, **over})


def _rec(ds, sid, prompt, output, text="an answer", **kw):
    return make_record(ds, sid, prompt=prompt, output=output, messages=[{"role": "user", "content": f"ask {sid}"}],
                       content=text, reasoning="thinking about it", **kw)


def _write_run(run_dir: Path) -> None:
    """Every kind of journal line the mix decides on, in two datasets."""
    write_jsonl(run_dir / "records" / "b1_glaive.jsonl", [
        _rec("b1_glaive", 1, (1, 2, 3), (10, 11, 2)),
        _rec("b1_glaive", 2, (1, 2, 3), None, finish_reason="error", error="timeout"),  # retried below
        _rec("b1_glaive", 3, (1, 2, 3), (12, 13, 14, 2), text="naïve café 日本語 🚀 \u2028 \"quoted\""),
        _rec("b1_glaive", 2, (1, 2, 3), (15, 16, 2)),
        _rec("b1_glaive", 4, (5, 6), (20, 21, 22, 2), tools=TOOLS,
             tool_calls=[{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]),
        _rec("b1_glaive", 5, (1, 2, 3), (10, 11, 2)),  # the same ids as b1_glaive/1: duplicate_ids
        _rec("b1_glaive", 6, (7,), None, source="api"),  # rebuilt by 02
        _rec("b1_glaive", 7, (7,), None, source="api"),  # 02 has no line for it: no_ids
        _rec("b1_glaive", 8, (1, 2), (30, 2)),
        _rec("b1_glaive", 8, (1, 2), (31, 2)),  # a key completed twice: duplicate_key
        _rec("b1_glaive", 9, (1, 2), (32, 33, 2)),  # fails the audit
        _rec("b1_glaive", 10, (1, 2), None, finish_reason="error", error="boom"),  # never retried
        *[_rec("b1_glaive", 100 + i, (1, 2, 3 + i), tuple(range(40 + i, 48 + 2 * i)) + (2,)) for i in range(12)],
    ])
    write_jsonl(run_dir / "records" / "b5_openthoughts.jsonl", [
        _rec("b5_openthoughts", "c/1", (1, 9), (50, 51, 2), turn=0),
        _rec("b5_openthoughts", "c/1", (1, 9, 50, 51, 2, 9), (52, 53, 2), turn=1),
        _rec("b5_openthoughts", "c/1", (1, 9, 50, 51, 2, 9, 52, 53, 2, 9), (54, 2), turn=2),
        _rec("b5_openthoughts", 7, (1, 2), (60, 61, 62), finish_reason="length"),
        *[_rec("b5_openthoughts", 200 + i, (4, 5 + i), (70 + i, 71, 2)) for i in range(9)],
    ])
    write_jsonl(run_dir / "reconstruct" / "b1_glaive.jsonl", [
        {"dataset": "b1_glaive", "sample_id": 6, "source": "api", "ids_exact": False, "proof_level": "token",
         "input_ids": [7, 80, 81, 82, 2], "loss_mask": [0, 1, 1, 1, 1]}])
    keys = [(r["dataset"], r["sample_id"], r.get("turn")) for f in sorted((run_dir / "records").glob("*.jsonl"))
            for r in map(orjson.loads, f.read_bytes().splitlines())]
    write_jsonl(run_dir / "audit" / "verdicts.jsonl", [
        {"dataset": d, "sample_id": s, **({"turn": t} if t is not None else {}),
         "failed": ["ends_with_end_of_turn"] if (d, s) == ("b1_glaive", 9) else [], "truncated": False}
        for d, s, t in dict.fromkeys(keys)])


def _files(folder: Path) -> dict:
    """What a hand-off holds: every line of its JSONL files, its dataset's rows, handoff.json without its times."""
    from datasets import load_from_disk

    out = {p.name: p.read_bytes() for p in folder.glob("*.jsonl")}
    run_dir = str(folder.parents[1])  # <run>/export/<format>: the runs compared have their own folders

    def read(name):
        return json.loads((folder / name).read_text().replace(run_dir, "<run>"))

    ho = read("handoff.json")
    out["handoff.json"] = {k: v for k, v in ho.items() if k not in ("created", "seconds")}
    man = read("manifest.json")
    out["manifest.json"] = {k: v for k, v in man.items() if k != "created"}
    if (folder / "state.json").exists():
        ds = load_from_disk(str(folder)).with_format(None)
        out["rows"] = [(r["input_ids"], r["loss_mask"], r["seq_len"]) for r in ds]
        out["columns"] = ds.column_names, str(ds.features), json.loads((folder / "state.json").read_text())["_format_type"]
    return out


def _export(root: Path, chunk: int, written_mix: bool = False, **over) -> dict:
    p = _params(root, f"chunk{chunk}{'w' if written_mix else ''}", chunk, **over)
    _write_run(p.run_dir)
    if written_mix:
        build_mix(p, max_context=8192)  # 04's mix.parquet: 05 reads it
    res = run_export(p)
    mix = build_mix(p, write=False, max_context=8192)
    return {"mix": mix.manifest, "samples": [(s.key, s.input_ids, s.loss_mask, s.source, s.ids_exact)
                                            for s in mix.samples],
            "selection": [(s.key, s.record) for s in select_samples(p)],
            **{fmt: _files(res.out_dir / fmt) for fmt in ONLINE_FORMATS},
            "vocab": (res.vocab.d2t.tolist(), res.vocab.t2d.sum(), res.counts.tolist())}


@pytest.mark.parametrize("written_mix", [False, True], ids=["mix-built-by-05", "mix-written-by-04"])
def test_one_row_at_a_time_equals_one_chunk_holding_everything(tmp_path, written_mix):
    small, whole = _export(tmp_path, 1, written_mix), _export(tmp_path, 10_000, written_mix)
    m = whole["mix"]
    assert {d["reason"] for d in m["dropped"]} >= {"superseded", "error", "duplicate_key", "no_ids", "duplicate_ids",
                                                   "audit_failed"}
    assert m["samples"] == 30 and m["turns"]["turn_samples"] == 3 and m["turns"]["repeated_prefix_tokens"] > 0
    for part in whole:
        assert small[part] == whole[part], part
    ho = whole["speculators_online"]["handoff.json"]
    assert ho["keys"] == [str(k) for k, *_ in whole["samples"]] == whole["specforge_online"]["handoff.json"]["keys"]
    assert whole["speculators_online"]["rows"] == [(ids, mask, len(ids)) for _, ids, mask, *_ in whole["samples"]]
    lines = [orjson.loads(x) for x in whole["specforge_online"]["prompts.jsonl"].splitlines()]
    assert [(x["id"], x["input_ids"], x["loss_mask"]) for x in lines] == \
        [(str(k), ids, mask) for k, ids, mask, *_ in whole["samples"]]
    conv = [orjson.loads(x) for x in whole["specforge_online"]["conversations.jsonl"].splitlines()]
    assert any("日本語" in t["content"] for c in conv for t in c["conversations"])
    assert any(c.get("tools") for c in conv) and len(conv) == 30


def test_a_short_window_cuts_and_drops_the_same_rows_in_chunks(tmp_path):
    small, whole = (_export(tmp_path, n, **{"export.online_max_length": 4}) for n in (3, 10_000))
    w = whole["speculators_online"]["handoff.json"]["window"]
    assert w["dropped"] and w["truncated"]
    for part in whole:
        assert small[part] == whole[part], part


def _big_run(root: Path, name: str, n: int, chunk: int):
    """n records of 2,000 tokens (half exact, half rebuilt by 02), audited."""
    p = _params(root, name, chunk)
    rng = np.random.default_rng(0)
    recs, rebuilt = [], []
    for i in range(n):
        ids = rng.integers(100, 49000, size=2000).tolist()
        if i % 2:
            recs.append(_rec("b1_glaive", i, ids[:200], ids[200:] + [2]))
        else:
            recs.append(_rec("b1_glaive", i, ids[:200], None, source="api"))
            rebuilt.append({"dataset": "b1_glaive", "sample_id": i, "ids_exact": False, "proof_level": "token",
                            "input_ids": ids + [2], "loss_mask": [0] * 200 + [1] * 1801})
    write_jsonl(p.run_dir / "records" / "b1_glaive.jsonl", recs)
    write_jsonl(p.run_dir / "reconstruct" / "b1_glaive.jsonl", rebuilt)
    write_jsonl(p.run_dir / "audit" / "verdicts.jsonl",
                [{"dataset": "b1_glaive", "sample_id": i, "failed": [], "truncated": False} for i in range(n)])
    return p


def _peak(p) -> int:
    tracemalloc.start()
    try:
        run_export(p)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_rise_with_the_number_of_records(tmp_path):
    """Python's peak while 05 builds the mix and writes both online hand-offs: set by the chunk, not the run."""
    n = 40
    run_export(_big_run(tmp_path, "warm", 4, 4))  # imports, the tokenizer, datasets' caches
    small, large = _big_run(tmp_path, "n", n, 4), _big_run(tmp_path, "4n", 4 * n, 4)
    peaks = _peak(small), _peak(large)
    per_record = (peaks[1] - peaks[0]) / (3 * n)  # holding a record's 2,001 ids as Python lists alone: ~72 kB
    assert peaks[1] < 1.3 * peaks[0] and per_record < 4000, (peaks, per_record)
    assert json.loads((large.run_dir / "export" / "speculators_online" / "handoff.json").read_text())["rows"] == 4 * n


def test_a_stale_written_mix_is_refused_before_anything_is_written(tmp_path):
    p = _params(tmp_path, "stale", 4)
    _write_run(p.run_dir)
    build_mix(p, max_context=8192)
    journal = p.run_dir / "records" / "b5_openthoughts.jsonl"
    journal.write_bytes(b"".join(x + b"\n" for x in journal.read_bytes().splitlines() if b'"c/1"' not in x))
    with pytest.raises(Exception, match="is not among the run's records: the mix is stale"):
        select_samples(p)
    assert len(read_mix(p.run_dir / "hidden")) == 30


KILL = {"rows": """
real, seen = R.Selection.chunks, [0]
def chunks(self):
    for c in real(self):
        seen[0] += 1
        if seen[0] == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        yield c
R.Selection.chunks = chunks
""", "handoff": """
def dies(*a, **kw):
    os.kill(os.getpid(), signal.SIGKILL)
R.online.write_specforge_online = dies
"""}


@pytest.mark.parametrize("where", list(KILL))
def test_a_kill_9_in_the_middle_then_the_same_command_completes_and_doubles_nothing(tmp_path, where):
    """05 killed by SIGKILL in its pass over the rows (after 8 of its 15 chunks of 2 rows), or after every row file
    was written but before SpecForge's hand-off was: run again, every file is as a clean run writes it."""
    p = _params(tmp_path, "killed", 2)
    _write_run(p.run_dir)
    run_export(p)
    clean = {fmt: _files(p.run_dir / "export" / fmt) for fmt in ONLINE_FORMATS}
    shutil.rmtree(p.run_dir / "export")
    over = {"output_root": str(tmp_path), "run_name": "killed", "hidden.enabled": False,
            "export.formats": list(ONLINE_FORMATS), "export.chunk_rows": 2, "hidden.mix_chunk_rows": 2}
    script = ("import os, signal\nfrom eagle3data.core.params import load_params\nfrom eagle3data.export import run as R\n"
              + KILL[where] + f"R.run_export(load_params({str(REPO / 'params' / 'ci.yaml')!r}, {over!r}))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (p.run_dir / "export" / "specforge_online" / "handoff.json").exists()
    left = [x.name for x in (p.run_dir / "export").rglob("*") if ".tmp" in x.name]
    assert left if where == "rows" else not left  # a killed pass leaves its temp files (no file half written)
    run_export(p)
    assert {fmt: _files(p.run_dir / "export" / fmt) for fmt in ONLINE_FORMATS} == clean
    assert not [x.name for x in (p.run_dir / "export").rglob("*") if ".tmp" in x.name]
