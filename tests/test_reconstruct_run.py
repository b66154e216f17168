"""run_reconstruct on a run folder: rebuilt API records beside the journal, summaries, drift."""

from __future__ import annotations

import shutil

import orjson
import pytest

from eagle3data.core.params import load_params
from eagle3data.rebuild.run import run_reconstruct, tool_call
from runfiles import synthetic_api_record
from eagle3data.core.records import Journal

REPO_PARAMS = "params/ci.yaml"


def test_drift_on_the_generated_run(ci_run, tmp_path, smollm2_tokenizer):
    root = tmp_path / "runs"
    shutil.copytree(ci_run.run_dir, root / ci_run.run_name)
    params = load_params(REPO_PARAMS, {"output_root": str(root)})
    res = run_reconstruct(params, progress=False, tokenizer=smollm2_tokenizer)
    table = res.drift_table()
    assert sorted(table.index) == sorted(d.name for d in params.datasets)
    assert (table["records"] == 2).all()
    assert table["exact_rate"].between(0, 1).all() and (table["ci95_low"] <= table["exact_rate"]).all()
    drift = orjson.loads((params.run_dir / "reconstruct" / "drift.json").read_bytes())
    assert drift["overall"]["n"] == 4
    summary = orjson.loads((params.run_dir / "reconstruct" / "summary.json").read_bytes())
    assert summary["api_records"] == 0 and res.table().empty
    assert (params.run_dir / "provenance" / "02_reconstruct.json").exists()


def test_api_records_are_rebuilt_beside_the_journal(tmp_path, qwen):
    params = load_params(REPO_PARAMS, {"output_root": str(tmp_path), "profile": "qwen3",
                                       "reconstruct.count_tolerance": 0.05})
    recs = [
        synthetic_api_record("b1_glaive", 1, reasoning="\nNeed the weather.\n", content="", prompt_ids=[1, 2, 3],
                             tool_calls=[tool_call("get_weather", {"city": "Oslo"})], completion_tokens=None,
                             provider="prov-a"),
        synthetic_api_record("b1_glaive", 2, reasoning="short", content="Hello!", completion_tokens=1000,
                             provider="prov-b"),
        synthetic_api_record("b1_glaive", 3, reasoning="cut", content=None, finish_reason="length",
                             completion_tokens=2, provider="prov-a"),
        {**synthetic_api_record("b1_glaive", 4, reasoning=None, content=None), "finish_reason": "error"},
    ]
    journal = params.run_dir / "records" / "b1_glaive.jsonl"
    with Journal(journal) as j:
        j.write_many(recs)
    before = journal.read_bytes()
    # billed count of record 1 = its true length, so the count check passes exactly there
    res = run_reconstruct(params, progress=False, tokenizer=qwen)
    lines = [orjson.loads(x) for x in (params.run_dir / "reconstruct" / "b1_glaive.jsonl").read_bytes().splitlines()]
    assert journal.read_bytes() == before  # the journal is never rewritten
    assert [ln["sample_id"] for ln in lines] == [1, 2, 3]  # the error record is skipped
    assert res.summary["errors_skipped"]["b1_glaive"] == 1
    for ln in lines:
        assert ln["ids_exact"] is False and ln["source"] == "api"
        assert ln["input_ids"] == ln["prompt_ids"] + ln["output_ids"]
        assert ln["loss_mask"] == [0] * len(ln["prompt_ids"]) + [1] * len(ln["output_ids"])
        assert ln["rebuilt_tokens"] == len(ln["output_ids"]) and ln["seam_ok"] and ln["roundtrip_ok"]
    first, second, third = lines
    assert first["prompt_ids"] == [1, 2, 3] and "prompt_templated_here" not in first["flags"]
    assert first["output_ids"][0] == 151667 and 151657 in first["output_ids"] and first["output_ids"][-1] == 151645
    assert "no_billed_count" in first["flags"]
    assert "count_outside_tolerance" in second["flags"] and second["count_diff"] == second["rebuilt_tokens"] - 1000
    assert second["prompt_ids"] and "prompt_templated_here" in second["flags"]
    assert qwen.decode(second["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert third["output_ids"][-1] != 151645 and "truncated_in_reasoning" in third["flags"]
    s = res.summary
    assert s["datasets"]["b1_glaive"]["records"] == 3
    assert set(s["providers"]) == {"prov-a", "prov-b"}
    billed = third["billed_tokens"] + second["billed_tokens"]
    rebuilt = third["rebuilt_tokens"] + second["rebuilt_tokens"]
    assert s["datasets"]["b1_glaive"]["count_diff_pct"] == pytest.approx(100 * (rebuilt - billed) / billed)
    assert res.flag_table().loc["b1_glaive", "truncated"] == 1
    assert res.provider_table().loc["prov-b", "count_outside_tolerance"] == 1
    assert res.drift["overall"]["n"] == 0  # no exact records in this run
