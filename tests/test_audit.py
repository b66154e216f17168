"""03_audit: reading journals, honest numbers, truncation, 02's rebuilt ids, the CLI, the stage and its report."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from eagle3data.audit.run import audit_table
from eagle3data.audit.checks import FAIL, NA, NOT_RUN, PASS
from eagle3data.audit.idtable import read_journal
from eagle3data.audit.runtable import load_run
from eagle3data.core.stats import upper95
from eagle3data.cli import main as cli_main
from eagle3data.core.profiles import KIMI_K25, SMOLLM2
from synthetic import SyntheticTokenizer, synthetic_id_table, synthetic_records

REPO = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


@pytest.fixture(scope="module")
def kimi_records():
    return synthetic_records(12, seed=7, max_output=900, tool_share=0.4, truncated_share=0.4)


def test_columnar_and_line_readers_agree(kimi_records, tmp_path):
    """pyarrow's reader (fast path) and the orjson line reader give the same ids and keys."""
    p = write_jsonl(tmp_path / "r.jsonl", kimi_records)
    fast, slow = read_journal(p), read_journal(p, source_fields=True)
    assert np.array_equal(fast.output, slow.output) and np.array_equal(fast.output_off, slow.output_off)
    assert np.array_equal(fast.prompt, slow.prompt)
    assert fast.meta["sample_id"].tolist() == slow.meta["sample_id"].tolist() == list(range(12))
    assert slow.messages[0] == kimi_records[0]["messages"]


def test_mixed_sample_id_types_and_torn_tail(kimi_records, tmp_path):
    recs = [dict(r) for r in kimi_records[:3]]
    recs[1]["sample_id"] = "abc"
    p = write_jsonl(tmp_path / "r.jsonl", recs)
    with open(p, "ab") as f:
        f.write(b'{"dataset": "synthetic", "sample_id": 99, "output_')  # a crash mid-write
    t = read_journal(p)
    assert t.meta["sample_id"].tolist() == [0, "abc", 2]
    assert t.torn_tail_bytes > 0


def test_truncated_is_reported_not_broken(kimi_records, tmp_path):
    res = audit_table(read_journal(write_jsonl(tmp_path / "r.jsonl", kimi_records)), KIMI_K25)
    v = res.verdicts()
    trunc = v["truncated"].to_numpy()
    assert trunc.any() and (~trunc).any()
    assert all(f == [] for f in v["failed"])
    assert (res.status.loc[trunc, "output.ends_with_eot"] == NA).all()
    assert (res.status.loc[~trunc, "output.ends_with_eot"] == PASS).all()
    # no tokenizer: the text checks say "not run", never "pass"
    assert (res.status["text.roundtrip"] == NOT_RUN).all() and (res.status["prompt.retemplate"] == NOT_RUN).all()
    assert res.check_summary().loc["text.roundtrip", "verdict"] == "not run"


def test_rule_of_three_and_records_needed():
    assert upper95(0, 300) == pytest.approx(0.01)
    assert upper95(0, 25) == pytest.approx(0.12)
    assert 0.01 < upper95(1, 100) < 0.06  # Wilson bound with one failure
    res = audit_table(synthetic_id_table(50, seed=1, max_output=400), KIMI_K25)
    row = res.check_summary().loc["output.single_eot"]
    assert row["applicable"] == 50 and row["failed"] == 0
    assert row["upper95"] == pytest.approx(3 / 50) and row["records_for_0.1%"] == 3000
    assert row["more_needed"] == 2950


def test_group_table_splits_by_source_and_provider(kimi_records, tmp_path):
    recs = [dict(r) for r in kimi_records]
    for r in recs[:4]:
        r["source"], r["provider"] = "api", "ProviderA"
    res = audit_table(read_journal(write_jsonl(tmp_path / "r.jsonl", recs)), KIMI_K25)
    g = res.group_table().set_index(["dataset", "source", "provider"])
    assert g.loc[("synthetic", "api", "ProviderA"), "records"] == 4
    assert g.loc[("synthetic", "sglang", "-"), "records"] == 8
    m = res.check_matrix()
    assert m.loc[("synthetic", "api", "ProviderA"), "output.single_eot"] == "0/4 (<75.0%)"


def test_api_records_use_rebuilt_ids_from_reconstruct_when_present(kimi_records, tmp_path):
    run = tmp_path / "run"
    api = [dict(r, source="api", provider="P", ids_exact=False) for r in kimi_records[:3] if r["finish_reason"] == "stop"]
    rebuilt = [{"dataset": r["dataset"], "sample_id": r["sample_id"], "output_ids": r["output_ids"],
                "prompt_ids": r["prompt_ids"], "input_ids": r["prompt_ids"] + r["output_ids"],
                "loss_mask": [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"]), "ids_exact": False}
               for r in api]  # the lines 02 writes
    for r in api:
        r["output_ids"] = None
    write_jsonl(run / "records" / "synthetic.jsonl", api)
    # 02 has not run: no ids, flagged, never silently clean
    res = audit_table(load_run(run), KIMI_K25)
    assert all(f == ["record.has_ids"] for f in res.failed_lists())
    write_jsonl(run / "reconstruct" / "synthetic.jsonl", rebuilt)
    t = load_run(run)
    assert t.meta["ids_from"].tolist() == ["reconstruct"] * len(api)
    res = audit_table(t, KIMI_K25, tokenizer=SyntheticTokenizer())
    assert all(f == [] for f in res.failed_lists())


def test_cli_writes_verdicts_and_summary(kimi_records, tmp_path, capsys):
    p = write_jsonl(tmp_path / "records" / "synthetic.jsonl", kimi_records)
    recs = list(kimi_records)
    bad = dict(recs[0], sample_id=100, output_ids=recs[0]["output_ids"][:-1] + [KIMI_K25.reasoning_open.id])
    write_jsonl(p, recs + [bad])
    with open(p, "ab") as f:
        f.write(b'{"dataset": "synthetic", "sample_id": 101, "output_')  # a write cut off
    out = tmp_path / "audit"
    # a CI gate: a failed record makes the exit status 1; the profile comes from the records
    assert cli_main(["audit", str(p), "--out", str(out)]) == 1
    said = capsys.readouterr().out
    assert "profile kimi-k2.5" in said and "1 failed" in said and "torn tail: " in said
    assert "tokenizer checks: NOT RUN: no recorded params" in said
    assert cli_main(["audit", str(p), "--out", str(out), "--allow-failed"]) == 0
    lines = [orjson.loads(x) for x in (out / "verdicts.jsonl").read_bytes().splitlines()]
    assert len(lines) == len(recs) + 1
    assert set(lines[0]) == {"dataset", "sample_id", "failed", "flagged", "truncated"}
    assert {"output.ends_with_eot", "output.no_reasoning_open"} <= set(lines[-1]["failed"])
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["records"] == len(recs) + 1 and summary["records_failed"] == 1
    assert summary["checks"]["text.roundtrip"]["verdict"] == "not run"


def test_cli_with_tokenizer_runs_text_checks(ci_run, tmp_path, capsys):
    p = ci_run.run_dir / "records" / "b1_glaive.jsonl"
    rc = cli_main(["audit", str(p), "--profile", "smollm2", "--out", str(tmp_path / "a"),
                   "--tokenizer", "embedded:smollm2", "--allow-failed"])
    assert rc == 0
    summary = orjson.loads((tmp_path / "a" / "summary.json").read_bytes())
    assert summary["checks"]["prompt.retemplate"]["applicable"] == 2
    assert summary["checks"]["prompt.retemplate"]["failed"] == 0
    assert summary["checks"]["output.single_reasoning_close"]["verdict"] == "n/a"
    # without --tokenizer: the run's own tokenizer, from its recorded params (the same checks run)
    capsys.readouterr()
    cli_main(["audit", str(p), "--out", str(tmp_path / "b"), "--allow-failed"])
    assert "tokenizer checks: run with the run's tokenizer (embedded:smollm2)" in capsys.readouterr().out
    again = orjson.loads((tmp_path / "b" / "summary.json").read_bytes())
    assert again["checks"] == summary["checks"]


def test_cli_unreadable_input_is_a_clear_error(tmp_path, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"dataset": "d", "sample_id": 1, "finish_reason": "stop", "output_ids": [1]}\nnot json\n')
    assert cli_main(["audit", str(p), "--profile", "smollm2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{p}:2" in err
    assert cli_main(["audit", str(tmp_path / "missing.jsonl"), "--profile", "smollm2", "--out", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err
    p.write_text('{"dataset": "d", "sample_id": 1, "finish_reason": "stop", "output_ids": "abc"}\n')
    assert cli_main(["audit", str(p), "--profile", "smollm2", "--out", str(tmp_path / "o")]) == 2
    assert "output_ids" in capsys.readouterr().err


def test_stage_on_the_ci_run(ci_run, smollm2_tokenizer, tmp_path):
    from eagle3data.audit.run import run_audit
    from eagle3data.audit.inspector import inspect_record

    params = ci_run.model_copy(update={"output_root": str(tmp_path)})
    shutil.copytree(ci_run.run_dir, params.run_dir)
    res = run_audit(params, progress=False, tokenizer=smollm2_tokenizer)
    verdicts = [orjson.loads(x) for x in (params.run_dir / "audit" / "verdicts.jsonl").read_bytes().splitlines()]
    assert len(verdicts) == 4 and all(v["failed"] == [] for v in verdicts)
    summary = orjson.loads((params.run_dir / "audit" / "summary.json").read_bytes())
    assert summary["checks"]["output.tool_calls_balanced"]["verdict"] == "n/a"
    assert (params.run_dir / "provenance" / "03_audit.json").exists()
    view = inspect_record(res, "b1_glaive", 1601, smollm2_tokenizer)  # not in the 2-prompt CI run
    assert not view.found and "1601 is not in this run" in view.html
    view = inspect_record(res, "b1_glaive", 1602, smollm2_tokenizer)
    assert view.found and "&lt;|im_start|&gt;" in view.html and "prompt.retemplate" in view.html


def test_notebook_renders_a_self_contained_report(ci_run, tmp_path):
    """`run --only 03` executes the notebook and writes report.html with embedded plots and the check table."""
    root = tmp_path / "runs"
    shutil.copytree(ci_run.run_dir, root / ci_run.run_name)
    proc = subprocess.run([sys.executable, "-m", "eagle3data", "run", str(REPO / "params" / "ci.yaml"),
                           "-p", "output_root", str(root), "--only", "03"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    html = (root / ci_run.run_name / "report.html").read_text(encoding="utf-8")
    assert "check-table" in html and html.count("data:image/png;base64") >= 5
    assert 'src="https://' not in html and 'src="http://' not in html
    assert "sample_id 1601 is not in this run" in html  # the inspector says it fell back
    assert "def " not in html.split("<body", 1)[1] or "run_audit(" not in html  # no code cells
