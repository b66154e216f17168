"""One sample, one truth: 02, 03, 04 and 05 read a run through one reader, with one key and one
selection rule, so no record is lost between 01 and the trainer.

The run is hand-made with the embedded SmolLM2 vocabulary (real chat-template prompts, canonical
outputs), so every honest record passes the audit and 04 runs the embedded model on it; the cases
are the ones that lost data before: a retried error, a real duplicate, caps and weights, a sample
longer than the model's context, an audit failure, and an API record rebuilt by 02.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest

from eagle3data.audit.run import run_audit
from eagle3data.export.run import run_export
from eagle3data.hidden.extract import run_extract
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.mix import DROP_REASONS, read_mix
from eagle3data.core.params import load_params
from eagle3data.core.profiles import SMOLLM2
from eagle3data.prompts.load import Prompt, template_prompt
from eagle3data.core.reader import SampleKey, read_rebuilt, read_verdicts
from eagle3data.rebuild.run import run_reconstruct
from eagle3data.core.spans import output_texts
from runfiles import key as skey

REPO = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _exact(tok, ds: str, sid: int, answer: str, *, finish: str = "stop", eot: bool = True) -> dict:
    """A local-backend record: templated prompt, canonical output ids, text fields from the one split."""
    msgs = [{"role": "user", "content": f"Question {sid} of {ds}: say something about {WORDS[sid % len(WORDS)]}."}]
    prompt_ids = template_prompt(tok, Prompt(ds, sid, msgs, None), SMOLLM2)
    out = list(tok.encode(answer, add_special_tokens=False)) + ([SMOLLM2.end_of_turn.id] if eot else [])
    text = output_texts(out, SMOLLM2, tok)
    return {"dataset": ds, "sample_id": sid, "source": "local", "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "profile": "smollm2", "messages": msgs, "tools": None, "prompt_ids": prompt_ids, "output_ids": out,
            "ids_exact": True, "reasoning": text.reasoning, "content": text.content, "tool_calls": None,
            "finish_reason": finish, "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out)}}


def _error(rec: dict) -> dict:
    return {**rec, "output_ids": None, "reasoning": None, "content": None, "finish_reason": "error",
            "error": "HTTP 503 after 3 attempts", "usage": {}}


def _api(tok, ds: str, sid: int, answer: str) -> dict:
    """An OpenAI-style record: text only, 02 rebuilds its ids."""
    rec = _exact(tok, ds, sid, answer)
    return {**rec, "source": "api", "output_ids": None, "prompt_ids": None, "ids_exact": False,
            "provider": "SomeProvider", "usage": {"completion_tokens": len(rec["output_ids"])}}


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


@pytest.fixture(scope="module")
def model(ci_run):
    from eagle3data.core.models import model_for

    return model_for(ci_run)


@pytest.fixture(scope="module")
def journal(smollm2_tokenizer):
    """Journal lines per dataset (in journal order), with the cases named in the module docstring."""
    tok = smollm2_tokenizer
    say = lambda i: " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 4)) + "."  # noqa: E731
    b1 = [_exact(tok, "b1_glaive", i, "Sure: " + say(i)) for i in range(1, 7)]
    retried = _exact(tok, "b1_glaive", 7, "Retried: " + say(7))
    b1 = [_error(retried)] + b1 + [retried]  # the error was journaled first; its retry succeeded on resume
    b1 += [_exact(tok, "b1_glaive", 8, "One answer."), _exact(tok, "b1_glaive", 8, "Another answer.")]  # real duplicate
    b1.append(_exact(tok, "b1_glaive", 9, "Long: " + " ".join(WORDS * 6)))  # longer than the context
    b5 = [_exact(tok, "b5_openthoughts", i, "Thinking: " + say(i + 5)) for i in range(1, 7)]
    b5.append(_exact(tok, "b5_openthoughts", 9, "No end of turn here", eot=False))  # fails output.ends_with_eot
    b5.append(_api(tok, "b5_openthoughts", 10, "An answer from the API: " + say(10)))
    return {"b1_glaive": b1, "b5_openthoughts": b5}


def _run(tmp_path: Path, journal: dict, tokenizer, model, **over):
    """Write the journals, then 02, 03, 04 and 05 as the notebooks run them; returns (params, audit, extract, export)."""
    # the journals are hand-written text, not the model's own output: verify-hidden's head checks fail them
    # (rightly), and this test is about keys and drops, so 05 is told to export anyway
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "model.max_context": 120,
                                                  "hidden.probe_batches": 0, "export.allow_unverified": True, **over})
    for name, rows in journal.items():
        _write(p.run_dir / "records" / f"{name}.jsonl", rows)
    (p.run_dir / "provenance").mkdir(parents=True, exist_ok=True)
    run_reconstruct(p, progress=False, tokenizer=tokenizer)
    audit = run_audit(p, progress=False, tokenizer=tokenizer)
    ext = run_extract(p, progress=False, model=model)
    exp = run_export(p)
    return p, audit, ext, exp


def test_a_retried_error_becomes_training_data(journal, smollm2_tokenizer, model, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p, audit, ext, exp = _run(tmp_path, journal, smollm2_tokenizer, model)
    key = skey("b1_glaive", "7")
    verdicts = read_verdicts(p.run_dir)
    assert verdicts[key]["failed"] == []  # audited as passing, not as a duplicate
    sup = audit.superseded
    assert sup[["dataset", "sample_id", "finish_reason", "line"]].values.tolist()[0] == ["b1_glaive", 7, "error", 1]
    assert audit.summary()["superseded_lines"] == len(sup) == 2  # the error, and the duplicate's first answer
    assert key in {s.key for s in read_mix(ext.hidden_dir).samples}
    assert str(key) in HiddenReader(ext.hidden_dir).keys()
    assert key in {s.key for s in exp.selection.samples}


def test_export_is_exactly_the_hidden_index_and_every_drop_has_one_reason(journal, smollm2_tokenizer, model,
                                                                          tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p, audit, ext, exp = _run(tmp_path, journal, smollm2_tokenizer, model, **{
        "hidden.dataset_caps": {"b1_glaive": 5}, "hidden.dataset_weights": {"b1_glaive": 1, "b5_openthoughts": 1},
        "hidden.weight_unit": "samples"})
    mix = read_mix(ext.hidden_dir)
    index_keys = HiddenReader(ext.hidden_dir).keys()
    assert index_keys == [str(s.key) for s in mix.samples] == [str(s.key) for s in exp.selection.samples]
    assert len(index_keys) == 10  # 5 of each dataset: the cap, then the equal weights
    # every journal line is in the mix or dropped, with exactly one reason from the one table
    lines = sum(len(rows) for rows in journal.values())
    assert mix.manifest["records_read"] == lines == len(mix.samples) + len(mix.dropped)
    assert {d["reason"] for d in mix.dropped} <= set(DROP_REASONS)
    fate = {}
    for d in mix.dropped:
        fate.setdefault((d["dataset"], d["sample_id"]), []).append(d["reason"])
    assert sorted(fate[("b1_glaive", "7")]) == ["superseded"]  # only its error line: the retry is in
    assert sorted(fate[("b1_glaive", "8")]) == ["duplicate_key", "superseded"]
    assert fate[("b1_glaive", "9")] == ["too_long"]
    assert fate[("b5_openthoughts", "9")] == ["audit_failed"]
    assert sorted(r for rs in fate.values() for r in rs if r in ("over_cap", "over_weight")) == \
        ["over_cap"] * 2 + ["over_weight"] * 2  # b1: 7 usable, cap 5; b5: 7 usable, weight cuts to 5
    for m in exp.manifests.values():
        assert m["exported"] == 10 and sum(m["skipped"].values()) == len(mix.dropped)


def test_the_same_record_has_one_key_ids_and_mask_in_every_stage(journal, smollm2_tokenizer, model, tmp_path,
                                                                 monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p, audit, ext, exp = _run(tmp_path, journal, smollm2_tokenizer, model)
    rebuilt = read_rebuilt(p.run_dir)
    reader = HiddenReader(ext.hidden_dir)
    exported = {s.key: s for s in exp.selection.samples}
    for key in (skey("b1_glaive", "7"), skey("b5_openthoughts", "10")):
        rows = [i for i in range(len(audit.meta)) if skey(audit.meta["dataset"].iloc[i],
                                                               audit.meta["sample_id"].iloc[i]) == key]
        assert len(rows) == 1  # 03: one row per sample
        i = rows[0]
        p03 = audit.table.prompt_ids(i).tolist()
        ids03 = p03 + audit.table.output_ids(i).tolist()
        mask03 = [0] * len(p03) + [1] * (len(ids03) - len(p03))
        stored = reader.sample(key)  # 04
        ids04, mask04 = stored["input_ids"].tolist(), stored["loss_mask"].tolist()
        ids05, mask05 = exported[key].input_ids, exported[key].loss_mask  # 05
        assert ids03 == ids04 == ids05 and mask03 == mask04 == mask05
        if key in rebuilt:  # 02's line for the API record
            assert rebuilt[key]["input_ids"] == ids03 and rebuilt[key]["loss_mask"] == mask03
    assert skey("b5_openthoughts", "10") in rebuilt
    shutil.rmtree(ext.hidden_dir)
