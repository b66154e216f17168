"""Exports for drafter trainers: round trips keep ids and masks, the draft vocabulary is right,
skipped records are the right ones and are counted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
import torch

from eagle3data.export.run import ExportError, conversation, export_format, params_of_run, select_samples
from eagle3data.export.vocab import build_draft_vocab, coverage_curve, load_draft_vocab, output_token_counts
from eagle3data.export.vocab import VocabError
from runfiles import iter_run_records

REPO = Path(__file__).resolve().parents[1]
VOCAB = 49152  # SmolLM2


@pytest.fixture
def run_copy(ci_run, tmp_path) -> Path:
    """A private copy of the CI run folder (tests write audit/ and reconstruct/ into it)."""
    dst = tmp_path / "run"
    shutil.copytree(ci_run.run_dir, dst)
    return dst


def _jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def _source(run_dir: Path) -> dict[str, dict]:
    return {f"{r['dataset']}/{r['sample_id']}": r for r in iter_run_records(run_dir)}


def _params(run_dir: Path, draft_vocab_size: int = 32000, **hidden):
    """The run's own params (as `eagle3data export RUN` reads them), with a draft vocabulary size."""
    p = params_of_run(run_dir)
    p.export.draft_vocab_size = draft_vocab_size
    for k, v in hidden.items():
        setattr(p.hidden, k, v)
    return p


def _export(run_dir: Path, out: Path, fmt: str, draft_vocab_size: int, **hidden) -> dict:
    return export_format(_params(run_dir, draft_vocab_size, **hidden), out, fmt)


def _expected(rec: dict) -> tuple[list[int], list[int]]:
    return rec["prompt_ids"] + rec["output_ids"], [0] * len(rec["prompt_ids"]) + [1] * len(rec["output_ids"])


def test_specforge_round_trip_keeps_ids_and_masks(run_copy, tmp_path):
    out = tmp_path / "sf"
    m = _export(run_copy, out, "specforge", 64)
    src = _source(run_copy)
    rows = _jsonl(out / "token_ids.jsonl")
    assert m["exported"] == len(rows) == len(src) == 4
    for row in rows:
        ids, mask = _expected(src[row["id"]])
        assert row["input_ids"] == ids and row["loss_mask"] == mask
        assert row["ids_exact"] is True and row["source"] == "local"
        assert {"dataset", "sample_id", "finish_reason"} <= row.keys()
        assert mask[len(src[row["id"]]["prompt_ids"]) - 1] == 0 and mask[-1] == 1  # end of turn is trained
    convs = {c["id"]: c for c in _jsonl(out / "conversations.jsonl")}
    assert convs.keys() == src.keys()
    for cid, c in convs.items():
        rec = src[cid]
        assert [t["role"] for t in c["conversations"]] == [mm["role"] for mm in rec["messages"]] + ["assistant"]
        assert c["conversations"][-1]["content"] == rec["content"]
        assert "reasoning_content" in c["conversations"][-1]
    vm = torch.load(out / "vocab_mapping.pt")
    d2t, t2d = load_draft_vocab(out / "draft_vocab.safetensors")
    assert np.array_equal(vm["d2t"].numpy(), d2t) and np.array_equal(vm["t2d"].numpy(), t2d)
    assert json.loads((out / "manifest.json").read_text())["exported"] == 4


def test_speculators_round_trip_keeps_ids_and_masks(run_copy, tmp_path):
    out = tmp_path / "spec"
    _export(run_copy, out, "speculators", 64)
    src = _source(run_copy)
    table = pq.read_table(out / "data.parquet").to_pylist()
    assert len(table) == len(src)
    for row in table:
        ids, mask = _expected(src[row["id"]])
        assert row["input_ids"] == ids and row["loss_mask"] == mask
    freq = torch.load(out / "token_freq.pt")
    outputs = [t for r in src.values() for t in r["output_ids"]]
    assert sum(freq.values()) == len(outputs)
    assert freq == {t: outputs.count(t) for t in set(outputs)}
    d2t, t2d = np.load(out / "d2t.npy"), np.load(out / "t2d.npy")
    assert d2t.dtype == np.int64 and t2d.dtype == bool and len(d2t) == 64 and len(t2d) == VOCAB


def test_d2t_and_t2d_agree(run_copy, tmp_path):
    out = tmp_path / "sf"
    _export(run_copy, out, "specforge", 128)
    d2t, t2d = load_draft_vocab(out / "draft_vocab.safetensors")
    assert d2t.dtype == np.int64 and d2t.shape == (128,) and t2d.dtype == bool and t2d.shape == (VOCAB,)
    target = np.arange(128) + d2t  # target_id = draft_id + d2t[draft_id]
    assert np.all(np.diff(target) > 0)  # ascending, no duplicates
    assert np.array_equal(np.flatnonzero(t2d), target)
    outputs = {t for r in iter_run_records(run_copy) for t in r["output_ids"]}
    assert outputs <= set(target.tolist())  # fewer distinct outputs than 128: all are in


def test_coverage_on_a_hand_made_example():
    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 3, 5, 1]] = [50, 30, 15, 5]  # 100 output tokens
    v = build_draft_vocab(counts, 2)
    assert v.draft_ids.tolist() == [3, 7] and v.d2t.tolist() == [3, 6]
    assert v.coverage == pytest.approx(0.80) and v.filled == 0
    assert np.flatnonzero(v.t2d).tolist() == [3, 7]
    assert build_draft_vocab(counts, 3).coverage == pytest.approx(0.95)
    # ties go to the smaller id
    tie = np.zeros(6, dtype=np.int64)
    tie[[4, 2]] = 5
    assert build_draft_vocab(tie, 1).draft_ids.tolist() == [2]
    assert coverage_curve(counts, [1, 2, 4, 100]) == pytest.approx({1: 0.5, 2: 0.8, 4: 1.0, 100: 1.0})


def test_fill_when_fewer_distinct_tokens_than_the_size():
    counts = np.zeros(10, dtype=np.int64)
    counts[[8, 2]] = [3, 1]
    v = build_draft_vocab(counts, 5)
    # the two seen ids, then the smallest unused ids 0, 1, 3
    assert v.draft_ids.tolist() == [0, 1, 2, 3, 8] and v.filled == 3 and v.coverage == 1.0
    with pytest.raises(VocabError, match="exceeds the target vocabulary"):
        build_draft_vocab(counts, 11)


def test_output_token_counts_use_loss_mask_only(run_copy):
    sel = select_samples(_params(run_copy))
    counts = output_token_counts(sel.samples, VOCAB)
    assert counts.sum() == sum(len(r["output_ids"]) for r in iter_run_records(run_copy))


def test_failed_and_unaudited_records_are_skipped_and_counted(run_copy, tmp_path):
    recs = list(iter_run_records(run_copy))
    failed, unaudited = recs[0], recs[1]
    verdicts = [{"dataset": r["dataset"], "sample_id": r["sample_id"], "failed": [], "truncated": True}
                for r in recs if r is not unaudited]
    verdicts[0]["failed"] = ["ends_with_end_of_turn"]
    _write_jsonl(run_copy / "audit" / "verdicts.jsonl", verdicts)
    m = _export(run_copy, tmp_path / "sf", "specforge", 32)
    assert m["exported"] == len(recs) - 2
    assert m["skipped"] == {"audit_failed": 1, "not_audited": 1}  # the mix's reasons (mix.DROP_REASONS)
    reasons = {(s["dataset"], s["sample_id"]): s["reason"] for s in m["skipped_samples"]}
    assert reasons[(failed["dataset"], str(failed["sample_id"]))] == "audit_failed"
    assert reasons[(unaudited["dataset"], str(unaudited["sample_id"]))] == "not_audited"
    ids = {r["id"] for r in _jsonl(tmp_path / "sf" / "token_ids.jsonl")}
    assert f"{failed['dataset']}/{failed['sample_id']}" not in ids
    # told otherwise (hidden.include_failed, the one rule's switch): no audit filter at all
    m2 = _export(run_copy, tmp_path / "sf2", "specforge", 32, include_failed=True)
    assert m2["exported"] == len(recs) and m2["skipped"] == {}


def _api_record(rec: dict, sample_id: int) -> dict:
    return {**rec, "sample_id": sample_id, "source": "api", "output_ids": None, "ids_exact": False,
            "reasoning": "think first", "provider": "SomeProvider"}


def test_api_records_take_rebuilt_ids_or_are_skipped(run_copy, tmp_path):
    base = next(iter_run_records(run_copy))
    journal = run_copy / "records" / f"{base['dataset']}.jsonl"
    with open(journal, "ab") as f:
        for sid in (9001, 9002):
            f.write(orjson.dumps(_api_record(base, sid)) + b"\n")
        f.write(orjson.dumps({**base, "sample_id": 9003, "output_ids": None, "finish_reason": "error"}) + b"\n")
    rebuilt_ids = base["prompt_ids"] + [11, 12, 2]
    rebuilt_mask = [0] * len(base["prompt_ids"]) + [1, 1, 1]
    _write_jsonl(run_copy / "reconstruct" / f"{base['dataset']}.jsonl", [
        {"dataset": base["dataset"], "sample_id": 9001, "source": "api", "ids_exact": False,
         "input_ids": rebuilt_ids, "loss_mask": rebuilt_mask, "flags": []}])
    m = _export(run_copy, tmp_path / "sp", "speculators", 32)
    assert m["skipped"] == {"error": 1, "no_ids": 1}
    assert m["ids_rebuilt"] == 1 and m["ids_exact"] == 4
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "sp" / "data.parquet").to_pylist()}
    api = rows[f"{base['dataset']}/9001"]
    assert api["input_ids"] == rebuilt_ids and api["loss_mask"] == rebuilt_mask and api["ids_exact"] is False
    conv = conversation(_api_record(base, 9001))
    assert conv["conversations"][-1]["reasoning_content"] == "think first"


def test_bad_reconstruct_line_names_file_line_and_field(run_copy, tmp_path):
    _write_jsonl(run_copy / "reconstruct" / "b1_glaive.jsonl",
                 [{"dataset": "b1_glaive", "sample_id": 1, "input_ids": [1, 2], "loss_mask": [0, 1]},
                  {"dataset": "b1_glaive", "sample_id": 2, "input_ids": [1, 2]}])
    with pytest.raises(ExportError, match=r"b1_glaive\.jsonl:2: missing field\(s\) loss_mask"):
        select_samples(_params(run_copy))


def test_cli_exports_and_reports(run_copy, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "eagle3data", "export", str(run_copy), "--format", "specforge",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "exported 4 samples" in proc.stdout and "coverage" in proc.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert m["draft_vocab"]["draft_vocab_size"] == 32000 and m["draft_vocab"]["target_vocab_size"] == VOCAB
    bad = subprocess.run([sys.executable, "-m", "eagle3data", "export", str(tmp_path / "nowhere"), "--format",
                          "speculators", "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "no such run folder" in bad.stderr  # the run lock refuses it (hold_run create=False)


def test_run_export_writes_both_formats_and_the_draft_vocab(ci_run, tmp_path):
    """What notebook 05 calls: both formats under <run>/export/, one draft vocab, coverage figure."""
    from eagle3data.export.run import run_export
    from eagle3data.core.params import load_params

    shutil.copytree(ci_run.run_dir, tmp_path / ci_run.run_name)
    params = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "export.draft_vocab_size": 40})
    res = run_export(params)
    out = tmp_path / ci_run.run_name / "export"
    assert (out / "specforge" / "token_ids.jsonl").exists() and (out / "speculators" / "data.parquet").exists()
    d2t, _ = load_draft_vocab(out / "draft_vocab.safetensors")
    assert np.array_equal(d2t, load_draft_vocab(out / "specforge" / "draft_vocab.safetensors")[0])
    assert len(d2t) == 40 and res.manifests["speculators"]["draft_vocab"]["coverage"] == res.vocab.coverage
    assert res.table()["exported"].sum() == 4
    assert set(res.files_table()["format"]) == {"specforge", "speculators"}
    assert res.coverage_figure().axes
