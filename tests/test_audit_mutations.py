"""Proof that the audit catches things: every corruption is flagged by the check named for it.

Clean records come from the small generated CI run (SmolLM2, plus completed copies of its
truncated outputs) and from synthetic Kimi-profile records; each mutation is applied to one
record, the journal is written and read back, and the audit must fail that record on the
named check (every check gating: `flag_only=()`). Clean records must pass every check. With the
default `audit.flag_only` the roundtrip mutant is flagged and kept, not failed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import orjson
import pytest

from eagle3data.audit.run import FLAG_ONLY, audit_table
from eagle3data.audit.checks import FAIL, FLAG
from eagle3data.audit.idtable import read_journal
from eagle3data.core.profiles import KIMI_K25, SMOLLM2, Profile
from eagle3data.prompts.load import Prompt, template_prompt
from eagle3data.core.records import read_records
from synthetic import SyntheticTokenizer, synthetic_records


def audit_records(records: list[dict[str, Any]], profile: Profile, tokenizer: Any, tmp_path: Path,
                  flag_only: tuple[str, ...] = ()):
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return audit_table(read_journal(path, source_fields=True), profile, tokenizer=tokenizer, flag_only=flag_only)


def failures(result) -> dict[int, list[str]]:
    return {i: f for i, f in enumerate(result.failed_lists()) if f}


# --------------------------------------------------------------------------- clean records


@pytest.fixture(scope="module")
def kimi_tok():
    return SyntheticTokenizer()


@pytest.fixture(scope="module")
def kimi_clean():
    recs = synthetic_records(16, seed=3, max_output=1500, tool_share=0.5, guard_share=0.3)
    assert any(r["tools"] for r in recs) and any(not r["tools"] for r in recs)
    return recs


@pytest.fixture(scope="module")
def smol_clean(ci_run, smollm2_tokenizer):
    """The CI run's records (truncated at 24 tokens) plus completed copies ending in end-of-turn."""
    recs = [r for p in sorted((ci_run.run_dir / "records").glob("*.jsonl")) for r in read_records(p)]
    done = []
    for r in recs:
        c = copy.deepcopy(r)
        c["sample_id"] = f"{r['sample_id']}-complete"
        c["output_ids"] = r["output_ids"][:16] + [SMOLLM2.end_of_turn.id]
        c["finish_reason"] = "stop"
        c["content"] = smollm2_tokenizer.decode(c["output_ids"][:-1], skip_special_tokens=False)
        done.append(c)
    return recs + done


def test_clean_kimi_records_pass_every_check(kimi_clean, kimi_tok, tmp_path):
    res = audit_records(kimi_clean, KIMI_K25, kimi_tok, tmp_path)
    assert failures(res) == {}
    # prompt.on_policy applies to turn records only (generate.turns: all; tests/test_turns.py), prompt.billed_count
    # to API records with a billed count (these are engine records; tests/test_billed_prompt.py)
    applicable = res.check_summary()["applicable"].drop(["prompt.on_policy", "prompt.billed_count"])
    # every check ran on these records: nothing is silently "not run" with a tokenizer
    assert (applicable > 0).all(), applicable[applicable == 0]


def test_clean_smollm2_records_pass_every_check(smol_clean, smollm2_tokenizer, tmp_path):
    res = audit_records(smol_clean, SMOLLM2, smollm2_tokenizer, tmp_path)
    assert failures(res) == {}
    summary = res.check_summary()
    # no reasoning, no tool-call tokens: those checks are n/a, never counted as passed
    for name in ("output.single_reasoning_close", "output.no_reasoning_open", "output.tool_calls_balanced",
                 "output.tool_calls_outside_reasoning", "output.reasoning_nonempty"):
        assert summary.loc[name, "applicable"] == 0 and summary.loc[name, "verdict"] == "n/a"
    assert summary.loc["output.ends_with_eot", "applicable"] == len(smol_clean) // 2  # truncated ones are exempt
    assert summary.loc["text.roundtrip", "applicable"] == len(smol_clean)


# --------------------------------------------------------------------------- mutations


def _ids(r: dict[str, Any]) -> list[int]:
    return list(r["output_ids"])


def _close_at(r: dict[str, Any], p: Profile) -> int:
    return r["output_ids"].index(p.reasoning_close.id)


def drop_close(r, p, tok):
    ids = _ids(r)
    ids.remove(p.reasoning_close.id)
    r["output_ids"] = ids


def dup_close(r, p, tok):
    ids = _ids(r)
    k = _close_at(r, p)
    r["output_ids"] = ids[: k + 2] + [p.reasoning_close.id] + ids[k + 2 :]


def leak_open(r, p, tok):
    ids = _ids(r)
    k = _close_at(r, p) // 2
    r["output_ids"] = ids[:k] + [p.reasoning_open.id] + ids[k:]


def drop_eot(r, p, tok):
    r["output_ids"] = [t for t in _ids(r) if t not in p.stop_ids]


def dup_eot(r, p, tok):
    ids = _ids(r)
    k = len(ids) - 3
    r["output_ids"] = ids[:k] + [p.end_of_turn.id] + ids[k:]


def truncate(r, p, tok):
    r["output_ids"] = _ids(r)[: len(r["output_ids"]) // 2]


def swap_reasoning_answer(r, p, tok):
    ids = _ids(r)
    k = _close_at(r, p)
    end = ids.index(p.end_of_turn.id)
    r["output_ids"] = ids[k + 1 : end] + [p.reasoning_close.id] + ids[:k] + ids[end:]


def merge_seam(r, p, tok):
    """Replace one multi-character token by two tokens that decode to the same text."""
    ids = _ids(r)
    for j, t in enumerate(ids):
        s = tok.decode([t])
        for cut in range(1, len(s)):
            a, b = tok.encode(s[:cut], add_special_tokens=False), tok.encode(s[cut:], add_special_tokens=False)
            if len(a) == 1 and len(b) == 1 and tok.decode(a + b) == s:
                r["output_ids"] = ids[:j] + a + b + ids[j + 1 :]
                return
    raise AssertionError("no token to split")


def unbalance_tools(r, p, tok):
    r["output_ids"] = [t for t in _ids(r) if t != p.tool_calls.section_end.id]


def tool_in_reasoning(r, p, tok):
    tc = p.tool_calls
    ids = _ids(r)
    sect = [tc.section_begin.id, tc.call_begin.id] + tok.encode("functions.x:0") + [tc.argument_begin.id] \
        + tok.encode("{}") + [tc.call_end.id, tc.section_end.id]
    k = _close_at(r, p) // 2
    r["output_ids"] = ids[:k] + sect + ids[k:]


def _retemplate(r, p, tok, messages, tools):
    r["prompt_ids"] = template_prompt(tok, Prompt(r["dataset"], r["sample_id"], messages, tools), p)


def remove_system(r, p, tok):
    _retemplate(r, p, tok, [m for m in r["messages"] if m["role"] != "system"], r["tools"])


def remove_tools(r, p, tok):
    _retemplate(r, p, tok, r["messages"], None)


def out_of_vocab(r, p, tok):
    ids = _ids(r)
    ids[1] = p.vocab_size + 5
    r["output_ids"] = ids


MUTATIONS: dict[str, tuple[Callable, str]] = {
    "drop_close": (drop_close, "output.single_reasoning_close"),
    "dup_close": (dup_close, "output.single_reasoning_close"),
    "leak_open": (leak_open, "output.no_reasoning_open"),
    "drop_eot": (drop_eot, "output.ends_with_eot"),
    "dup_eot": (dup_eot, "output.single_eot"),
    "truncate": (truncate, "output.ends_with_eot"),
    "swap_reasoning_answer": (swap_reasoning_answer, "text.fields_match"),
    "merge_seam": (merge_seam, "text.roundtrip"),
    "unbalanced_tool_calls": (unbalance_tools, "output.tool_calls_balanced"),
    "tool_call_in_reasoning": (tool_in_reasoning, "output.tool_calls_outside_reasoning"),
    "remove_system_prompt": (remove_system, "prompt.system_present"),
    "remove_tool_definitions": (remove_tools, "prompt.tools_present"),
    "out_of_vocab": (out_of_vocab, "output.ids_in_vocab"),
}
KIMI_ONLY = {"drop_close", "dup_close", "leak_open", "swap_reasoning_answer", "unbalanced_tool_calls",
             "tool_call_in_reasoning"}
NEEDS_TOOLS = {"unbalanced_tool_calls", "remove_tool_definitions"}
NEEDS_SYSTEM = {"remove_system_prompt"}


def _target(records: list[dict[str, Any]], mutation: str) -> int:
    for i, r in enumerate(records):
        if r["finish_reason"] != "stop":
            continue
        if mutation in NEEDS_TOOLS and not r.get("tools"):
            continue
        if mutation in NEEDS_SYSTEM and not any(m["role"] == "system" for m in r["messages"]):
            continue
        return i
    raise AssertionError(f"no clean record fits mutation {mutation}")


def _flags_mutant(records, profile, tok, mutation, tmp_path):
    fn, check = MUTATIONS[mutation]
    recs = copy.deepcopy(records)
    i = _target(recs, mutation)
    fn(recs[i], profile, tok)
    res = audit_records(recs, profile, tok, tmp_path)
    fails = failures(res)
    assert check in fails.get(i, []), f"{mutation} not flagged by {check}; record {i} failed {fails.get(i)}"
    assert set(fails) == {i}, f"{mutation} also flagged clean records: {fails}"


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_kimi_mutant_is_flagged_by_its_check(mutation, kimi_clean, kimi_tok, tmp_path):
    _flags_mutant(kimi_clean, KIMI_K25, kimi_tok, mutation, tmp_path)


@pytest.mark.parametrize("mutation", sorted(set(MUTATIONS) - KIMI_ONLY))
def test_smollm2_mutant_is_flagged_by_its_check(mutation, smol_clean, smollm2_tokenizer, tmp_path):
    _flags_mutant(smol_clean, SMOLLM2, smollm2_tokenizer, mutation, tmp_path)


@pytest.mark.parametrize("profile_name", ["kimi", "smollm2"])
def test_duplicate_sample_is_flagged(profile_name, kimi_clean, kimi_tok, smol_clean, smollm2_tokenizer, tmp_path):
    recs, prof, tok = ((kimi_clean, KIMI_K25, kimi_tok) if profile_name == "kimi"
                       else (smol_clean, SMOLLM2, smollm2_tokenizer))
    recs = copy.deepcopy(recs) + [copy.deepcopy(recs[1])]  # two completed records for one sample
    res = audit_records(recs, prof, tok, tmp_path)
    fails = failures(res)
    # the sample's record is its latest line, and it fails; the earlier line is shown as superseded
    assert fails == {len(recs) - 2: ["dataset.unique_sample_id"]}
    assert res.meta["sample_id"].iloc[len(recs) - 2] == recs[1]["sample_id"]
    assert res.superseded[["sample_id", "line", "record_line"]].values.tolist() == [[recs[1]["sample_id"], 2, len(recs)]]


@pytest.mark.parametrize("profile_name", ["kimi", "smollm2"])
def test_retried_error_is_superseded_not_a_failure(profile_name, kimi_clean, kimi_tok, smol_clean, smollm2_tokenizer,
                                                   tmp_path):
    recs, prof, tok = ((kimi_clean, KIMI_K25, kimi_tok) if profile_name == "kimi"
                       else (smol_clean, SMOLLM2, smollm2_tokenizer))
    err = {**copy.deepcopy(recs[0]), "output_ids": None, "reasoning": None, "content": None,
           "finish_reason": "error", "error": "HTTP 503"}
    recs = [err] + copy.deepcopy(recs)  # the error was journaled first; its retry succeeded later
    res = audit_records(recs, prof, tok, tmp_path)
    assert failures(res) == {}
    assert len(res.meta) == len(recs) - 1
    assert res.superseded[["sample_id", "finish_reason", "line"]].values.tolist() == [[err["sample_id"], "error", 1]]
    assert res.summary()["superseded_lines"] == 1 and res.summary()["records_failed"] == 0


def test_identical_output_for_a_different_prompt_is_flagged(kimi_clean, kimi_tok, tmp_path):
    recs = copy.deepcopy(kimi_clean)
    a, b = [i for i, r in enumerate(recs) if r["finish_reason"] == "stop" and not r["tools"]][:2]
    recs[b]["output_ids"] = list(recs[a]["output_ids"])
    recs[b]["reasoning"], recs[b]["content"] = recs[a]["reasoning"], recs[a]["content"]
    fails = failures(audit_records(recs, KIMI_K25, kimi_tok, tmp_path))
    assert fails == {a: ["dataset.distinct_outputs"], b: ["dataset.distinct_outputs"]}


def test_prompt_without_generation_prompt_is_flagged(kimi_clean, kimi_tok, tmp_path):
    recs = copy.deepcopy(kimi_clean)
    recs[2]["prompt_ids"] = recs[2]["prompt_ids"][:-1]  # drop the trailing <think>
    fails = failures(audit_records(recs, KIMI_K25, kimi_tok, tmp_path))
    assert set(fails) == {2} and "prompt.generation_prompt" in fails[2] and "prompt.retemplate" in fails[2]


def test_roundtrip_flags_by_default_and_the_record_is_kept(smol_clean, smollm2_tokenizer, tmp_path):
    """audit.flag_only's default: a non-canonical split is flagged (counted, shown), not failed (kept in the mix)."""
    recs = copy.deepcopy(smol_clean)
    i = _target(recs, "merge_seam")
    merge_seam(recs[i], SMOLLM2, smollm2_tokenizer)
    res = audit_records(recs, SMOLLM2, smollm2_tokenizer, tmp_path, flag_only=FLAG_ONLY)
    assert failures(res) == {}
    assert res.status.at[i, "text.roundtrip"] == FLAG
    assert {j: f for j, f in enumerate(res.failed_lists(FLAG)) if f} == {i: ["text.roundtrip"]}
    s = res.summary()
    assert (s["records_failed"], s["records_flagged"]) == (0, 1)
    c = s["checks"]["text.roundtrip"]
    assert (c["failed"], c["flagged"], c["gates"], c["applicable"]) == (0, 1, False, len(recs))
    assert c["verdict"] == f"flagged 1/{len(recs)}"
    assert s["checks"]["output.single_eot"]["gates"] is True
    vp, _ = res.write(tmp_path / "audit")
    lines = [orjson.loads(ln) for ln in vp.read_bytes().splitlines()]
    assert (lines[i]["failed"], lines[i]["flagged"]) == ([], ["text.roundtrip"])
    assert "flagged 1/" in res.check_matrix().to_string()
    gated = audit_records(recs, SMOLLM2, smollm2_tokenizer, tmp_path, flag_only=())
    assert failures(gated) == {i: ["text.roundtrip"]} and gated.summary()["records_flagged"] == 0


def test_flag_only_names_a_check(smol_clean, smollm2_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="audit.flag_only: no check named 'text.round_trip'"):
        audit_records(smol_clean[:1], SMOLLM2, smollm2_tokenizer, tmp_path, flag_only=("text.round_trip",))
