"""02_reconstruct: rebuild per profile, flags (never fixes), seam/roundtrip/count checks, drift.

Every behaviour runs on two vocabularies: SmolLM2 (with a stand-in reasoning profile that
borrows SmolLM2's own added tokens for think/tool-call/guard, Kimi-style tool calls) and the
Qwen3 BPE with the qwen3 profile.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from eagle3data.core.profiles import QWEN3, SMOLLM2
from eagle3data.core.stats import wilson_interval
from eagle3data.rebuild.run import measure_drift, tool_call
from eagle3data.rebuild.assemble import ApiTurn
from eagle3data.rebuild.text import rebuild_batch

# SmolLM2 has no think or tool-call tokens: SMOL_REASONING borrows its unused added tokens so
# the reasoning, guard and Kimi-style tool-call paths run on that vocabulary too.
from runfiles import SMOL_REASONING  # noqa: E402

ADVERSARIAL = {
    "combining": "re\u0301sume\u0301 with a\u0308 and o\u0302",
    "emoji_zwj": "team 👩‍💻👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽!",
    "cjk": "这是一个测试。これはテストです。테스트입니다.",
    "mixed_scripts": "Hello мир שלום 世界 مرحبا Γειά",
    "whitespace": "a" + " " * 120 + "b\n\n\n\n\n   \t \n" + " " * 33,
    "code_tabs": "def f(x):\n\tfor i in range(x):\n\t\tprint(i)\t# tab\n",
    "im_end_in_code": "Use it like this:\n```python\nstop = '<|im_end|>'\n```\nDone.",
}


@pytest.fixture(params=["smollm2", "qwen3"])
def vocab(request, smollm2_tokenizer, qwen):
    """(tokenizer, profile) for each vocabulary."""
    return (smollm2_tokenizer, SMOL_REASONING) if request.param == "smollm2" else (qwen, QWEN3)


def one(tok, prof, turn, **kw):
    return rebuild_batch([turn], tok, prof, **kw)[0]


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_layout_open_reasoning_close_content_end_of_turn(vocab):
    tok, prof = vocab
    rb = one(tok, prof, ApiTurn("\nI think.\n", "\n\nThe answer.", finish_reason="stop", prompt_ids=[1, 2],
                                billed_tokens=None))
    want = ([prof.reasoning_open.id] + enc(tok, "\nI think.\n") + [prof.reasoning_close.id]
            + enc(tok, "\n\nThe answer.") + [prof.end_of_turn.id])
    assert rb.output_ids == want
    assert rb.seam_ok and rb.roundtrip_ok
    assert tok.decode(rb.output_ids, skip_special_tokens=False) == rb.text


def test_no_reasoning_open_when_the_prompt_already_ends_with_it(vocab):
    tok, prof = vocab
    rb = one(tok, prof, ApiTurn("r", "c", prompt_ids=[5, prof.reasoning_open.id], billed_tokens=4))
    assert prof.reasoning_open.id not in rb.output_ids
    assert rb.output_ids[-1] == prof.end_of_turn.id


def test_guard_only_when_asked(vocab):
    tok, prof = vocab
    turn = ApiTurn("r", "c", billed_tokens=5)
    plain = one(tok, prof, turn)
    guarded = one(tok, prof, turn, append_guard=True)
    if prof.guard is None:
        assert guarded.output_ids == plain.output_ids
    else:
        assert guarded.output_ids == plain.output_ids + [prof.guard.id]


def test_length_gets_no_end_of_turn(vocab):
    tok, prof = vocab
    rb = one(tok, prof, ApiTurn("thinking", "partial answ", finish_reason="length", billed_tokens=6))
    assert "truncated" in rb.flags
    assert prof.end_of_turn.id not in rb.output_ids
    assert rb.output_ids[-1] != prof.end_of_turn.id


def test_cut_inside_reasoning_gets_no_reasoning_close(vocab):
    tok, prof = vocab
    rb = one(tok, prof, ApiTurn("still thinking", None, finish_reason="length", billed_tokens=4))
    assert {"truncated", "truncated_in_reasoning"} <= set(rb.flags)
    assert prof.reasoning_close.id not in rb.output_ids and prof.end_of_turn.id not in rb.output_ids


@pytest.mark.parametrize("turn_kw, flag", [
    ({"reasoning": "", "content": "answer"}, "empty_reasoning"),
    ({"reasoning": None, "content": None}, "empty_output"),
    ({"reasoning": "r", "content": "done{eot} and more"}, "content_has_end_of_turn"),
    ({"reasoning": "r", "content": "see {close} here"}, "content_has_reasoning_token"),
    ({"reasoning": "r", "content": "raw {call} call"}, "content_has_tool_call_token"),
    ({"reasoning": "I will {call} now", "content": "x"}, "reasoning_has_tool_call_token"),
    ({"reasoning": "a {close} b", "content": "x"}, "reasoning_has_reasoning_token"),
    ({"reasoning": "a {eot} b", "content": "x"}, "reasoning_has_end_of_turn"),
    ({"reasoning": "r", "content": "x", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
     "bad_tool_call"),
])
def test_each_flag_is_raised_and_the_text_kept(vocab, turn_kw, flag):
    tok, prof = vocab
    names = {"eot": prof.end_of_turn.text, "close": prof.reasoning_close.text,
             "call": prof.tool_calls.call_begin.text}
    kw = {k: (v.format(**names) if isinstance(v, str) else v) for k, v in turn_kw.items()}
    rb = one(tok, prof, ApiTurn(billed_tokens=10, **kw))
    assert flag in rb.flags
    # never silently fixed: the text is all there, special tokens inside it became their single ids
    for part in (kw.get("reasoning"), kw.get("content")):
        if part:
            assert part in rb.text
    for t in prof.special_tokens():
        for part in (kw.get("reasoning") or "", kw.get("content") or ""):
            if t.text in part:
                assert rb.output_ids.count(t.id) >= 1
    assert rb.roundtrip_ok and rb.seam_ok


def test_clean_turn_has_no_problem_flags(vocab):
    tok, prof = vocab
    rb = one(tok, prof, ApiTurn("think", "answer", billed_tokens=None))
    assert rb.flags == ["no_billed_count"]


def test_count_check_against_billed_tokens(vocab):
    tok, prof = vocab
    turn = ApiTurn("think about it", "the answer is 42", billed_tokens=None)
    n = len(one(tok, prof, turn).output_ids)
    ok = one(tok, prof, replace(turn, billed_tokens=n), count_tolerance=0.0)
    off = one(tok, prof, replace(turn, billed_tokens=n + 3), count_tolerance=0.01)
    within = one(tok, prof, replace(turn, billed_tokens=n + 1), count_tolerance=0.5)
    assert ok.count_diff == 0 and "count_outside_tolerance" not in ok.flags
    assert off.count_diff == -3 and "count_outside_tolerance" in off.flags
    assert within.count_diff == -1 and "count_outside_tolerance" not in within.flags


def test_tool_calls_rendered_in_native_form(vocab):
    tok, prof = vocab
    calls = [tool_call("get_weather", {"city": "Paris"}, "functions.get_weather:0"),
             tool_call("get_time", {"tz": "UTC"}, "functions.get_time:1")]
    rb = one(tok, prof, ApiTurn("need data", "Checking.", calls, billed_tokens=None))
    tc = prof.tool_calls
    assert rb.output_ids.count(tc.call_begin.id) == 2 and rb.output_ids.count(tc.call_end.id) == 2
    assert rb.output_ids[-1] == prof.end_of_turn.id and rb.seam_ok and rb.roundtrip_ok
    if tc.style == "qwen3":
        assert rb.text.endswith('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
                                "</tool_call><|im_end|>")
    else:
        assert (tc.section_begin.text + tc.call_begin.text + "functions.get_weather:0" + tc.argument_begin.text
                + '{"city": "Paris"}' + tc.call_end.text) in rb.text
        assert rb.output_ids[-2] == tc.section_end.id


def test_tool_calls_without_native_form_are_flagged_not_invented(smollm2_tokenizer):
    rb = one(smollm2_tokenizer, SMOLLM2, ApiTurn(None, "ok", [tool_call("f", {})], billed_tokens=None))
    assert "tool_calls_without_native_form" in rb.flags
    assert rb.output_ids == enc(smollm2_tokenizer, "ok") + [2]


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
@pytest.mark.parametrize("seam_check", ["offsets", "reencode"])
def test_adversarial_text(vocab, name, seam_check):
    tok, prof = vocab
    text = ADVERSARIAL[name]
    rb = one(tok, prof, ApiTurn(text, text, billed_tokens=None), seam_check=seam_check)
    assert rb.seam_ok, rb.seam_first_diff
    assert rb.output_ids == enc(tok, rb.text)  # same ids as encoding the whole assembled text
    nfc_changes = prof is QWEN3 and name == "combining"  # Qwen normalizes to NFC: decode differs, flagged
    assert rb.roundtrip_ok is not nfc_changes
    assert ("roundtrip_mismatch" in rb.flags) is nfc_changes
    if name == "im_end_in_code":  # the look-alike is the real token: one id, and flagged
        assert {"content_has_end_of_turn", "reasoning_has_end_of_turn"} <= set(rb.flags)
        assert rb.output_ids.count(prof.end_of_turn.id) == 3  # reasoning, content, and the real end


def _overlapping(tok, extra: str):
    """A copy of the tokenizer with one more added token that swallows a seam."""
    from tokenizers import AddedToken

    t = copy.deepcopy(tok)
    t.add_tokens([AddedToken(extra, normalized=False)])
    return t


@pytest.mark.parametrize("seam_check", ["offsets", "reencode"])
def test_seam_mismatch_is_detected_with_its_position(vocab, seam_check):
    tok, prof = vocab
    bad = _overlapping(tok, "zq" + prof.end_of_turn.text[:4])  # "…zq" + "<|im" becomes one token
    turn = ApiTurn("r", "abc zq", billed_tokens=None)
    good = one(tok, prof, turn, seam_check=seam_check)
    rb = one(bad, prof, turn, seam_check=seam_check)
    assert good.seam_ok
    assert not rb.seam_ok and "structure_token_split" in rb.flags
    assert rb.seam_first_diff is not None and 0 < rb.seam_first_diff <= len(good.output_ids)


def test_batch_equals_one_by_one(vocab):
    tok, prof = vocab
    turns = [ApiTurn(t, t[::-1], finish_reason=fr, billed_tokens=9)
             for t in ADVERSARIAL.values() for fr in ("stop", "length")]
    batch = rebuild_batch(turns, tok, prof)
    assert [b.output_ids for b in batch] == [one(tok, prof, t).output_ids for t in turns]


def _mixed_turns(prof):
    """Clean, truncated, tool-call and seam-swallowing ("… zq" before end-of-turn) turns."""
    turns = [ApiTurn(t, t[::-1], finish_reason=fr, billed_tokens=b)
             for t in ADVERSARIAL.values() for fr, b in (("stop", 9), ("length", None))]
    turns += [ApiTurn("r", "abc zq", billed_tokens=4), ApiTurn("r", "", [tool_call("f", {"a": 1})], billed_tokens=20)]
    return turns


def test_seam_fast_path_agrees_with_the_full_offset_scan(vocab):
    from eagle3data.rebuild.assemble import _special_texts, assemble_segments as _assemble
    from eagle3data.rebuild.text import _join, _seam_by_offsets, _seam_diff_by_offsets

    tok, prof = vocab
    bad = _overlapping(tok, "zq" + prof.end_of_turn.text[:4])
    mismatches = 0
    for t in (tok, bad):
        bt = t.backend_tokenizer
        for turn in _mixed_turns(prof):
            text, seams = _join(_assemble(turn, prof, _special_texts(prof), False)[0])
            e = bt.encode(text, add_special_tokens=False)
            full = _seam_by_offsets(seams, e.ids, e.offsets)
            assert _seam_diff_by_offsets(e, e.ids, seams) == full
            mismatches += full is not None
    assert mismatches >= 1  # the swallowed seam is found by both

# ---------------------------------------------------------------- drift


def _exact_record(ids, sid=1, finish="stop"):
    return {"sample_id": sid, "output_ids": ids, "finish_reason": finish, "prompt_ids": [1], "usage": {},
            "ids_exact": True}


def test_drift_canonical_outputs_match_exactly(vocab):
    tok, prof = vocab
    recs = []
    for i, text in enumerate(ADVERSARIAL.values()):
        if prof is QWEN3 and text is ADVERSARIAL["combining"]:
            continue  # NFC: decode(encode(t)) != t by design, covered in test_adversarial_text
        ids = ([prof.reasoning_open.id] + enc(tok, "let me see " + text) + [prof.reasoning_close.id]
               + enc(tok, "\n\n" + text) + [prof.end_of_turn.id])
        recs.append(_exact_record(ids, i))
    recs.append(_exact_record([prof.reasoning_open.id] + enc(tok, "cut off mid"), 99, "length"))
    dr = measure_drift(recs, tok, prof, dataset="d")
    assert dr.n == len(recs) and dr.exact == dr.n and dr.rate == 1.0 and dr.examples == []


def test_drift_detects_a_non_canonical_split(vocab):
    tok, prof = vocab
    word = " understanding"
    canon = enc(tok, word)
    assert len(canon) == 1  # one token in both vocabularies
    split = enc(tok, " under") + enc(tok, "standing")  # the same text, split the way a sampler might
    assert tok.decode(split) == word
    ids = [prof.reasoning_open.id] + enc(tok, "ok") + [prof.reasoning_close.id] + enc(tok, "Full") + split \
        + [prof.end_of_turn.id]
    good = [prof.reasoning_open.id] + enc(tok, "ok") + [prof.reasoning_close.id] + enc(tok, "Full" + word) \
        + [prof.end_of_turn.id]
    dr = measure_drift([_exact_record(ids, 1), _exact_record(good, 2)], tok, prof, dataset="d")
    assert dr.n == 2 and dr.exact == 1 and dr.text_equal == 2
    pos = ids.index(split[0])
    assert dr.first_divergence == [pos]
    ex = dr.examples[0]
    assert ex["sample_id"] == 1 and ex["position"] == pos
    row = pos - ex["window_start"]
    assert ex["true"][row] == [split[0], tok.decode([split[0]])]
    assert ex["rebuilt"][row][0] == canon[0]


def test_drift_roundtrips_native_tool_calls(qwen, smollm2_tokenizer):
    for tok, prof in ((qwen, QWEN3), (smollm2_tokenizer, SMOL_REASONING)):
        calls = [tool_call("f", {"a": 1, "b": "ü"}, "functions.f:0"), tool_call("g", {}, "functions.g:1")]
        rb = one(tok, prof, ApiTurn("why", "Calling.", calls, billed_tokens=None))
        parts = prof.split_output(rb.output_ids)
        assert parts.calls is not None and len(parts.calls) == 2
        dr = measure_drift([_exact_record(rb.output_ids)], tok, prof)
        assert dr.exact == 1, dr.examples


def test_wilson_interval():
    lo, hi = wilson_interval(0, 25)
    assert lo == 0.0 and 0.12 < hi < 0.14  # zero failures in 25 still allows ~13%
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(0, 0) == (0.0, 1.0)


def _both_roundtrips(tok, prof, turns, monkeypatch):
    """rebuild_batch with the byte-table roundtrip and with decode_batch (same turns)."""
    import eagle3data.rebuild.text as rec  # rebuild_batch reads its own module's threshold

    monkeypatch.setattr(rec, "BYTE_TABLE_MIN_RECORDS", 0)
    fast = rebuild_batch(turns, tok, prof)
    monkeypatch.setattr(rec, "BYTE_TABLE_MIN_RECORDS", 10**9)
    slow = rebuild_batch(turns, tok, prof)
    return fast, slow


def test_byte_table_roundtrip_gives_the_decode_verdict(vocab, monkeypatch):
    from eagle3data.rebuild.text import _byte_table

    tok, prof = vocab
    assert _byte_table(tok.backend_tokenizer) is not None  # both vocabularies decode with ByteLevel
    turns = [ApiTurn(t, t[::-1], finish_reason=fr, billed_tokens=9)
             for t in ADVERSARIAL.values() for fr in ("stop", "length")]
    fast, slow = _both_roundtrips(tok, prof, turns, monkeypatch)
    assert [(r.roundtrip_ok, r.flags, r.output_ids) for r in fast] == [(r.roundtrip_ok, r.flags, r.output_ids)
                                                                      for r in slow]
    if prof is QWEN3:  # NFC composes the combining marks: decode differs from the text, and both say so
        assert not fast[0].roundtrip_ok and "roundtrip_mismatch" in fast[0].flags


def test_byte_table_covers_added_tokens_outside_the_byte_alphabet(smollm2_tokenizer, monkeypatch):
    from tokenizers import AddedToken

    from eagle3data.rebuild.text import _byte_table

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_tokens([AddedToken("naïve→", normalized=False), AddedToken("<ünï>", special=True)])
    assert _byte_table(tok.backend_tokenizer) is not None
    turns = [ApiTurn("a naïve→ b", "x <ünï> y", billed_tokens=None)]
    fast, slow = _both_roundtrips(tok, SMOL_REASONING, turns, monkeypatch)
    assert fast[0].output_ids == slow[0].output_ids and fast[0].roundtrip_ok == slow[0].roundtrip_ok


def test_no_byte_table_without_a_byte_level_decoder(smollm2_tokenizer, monkeypatch):
    from tokenizers import decoders

    from eagle3data.rebuild.text import _byte_table

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.backend_tokenizer.decoder = decoders.Metaspace()
    assert _byte_table(tok.backend_tokenizer) is None
    fast, slow = _both_roundtrips(tok, SMOL_REASONING, [ApiTurn("r", "hello world", billed_tokens=None)], monkeypatch)
    assert [r.roundtrip_ok for r in fast] == [r.roundtrip_ok for r in slow]



# ---------------------------------------------------------------- proof levels (issue 15)


def test_assemble_with_the_tokenizer_flags_any_added_token_text(vocab):
    from eagle3data.rebuild.assemble import assemble

    tok, prof = vocab
    turn = ApiTurn("r", "before <|im_start|> after", billed_tokens=None)
    assert "content_has_added_token_text" not in assemble(turn, prof)[1]  # without the tokenizer: profile texts only
    assert "content_has_added_token_text" in assemble(turn, prof, tokenizer=tok)[1]


def test_structure_token_split_lowers_the_level(vocab):
    tok, prof = vocab
    bad = _overlapping(tok, "zq" + prof.end_of_turn.text[:4])
    turn = ApiTurn("r", "abc zq", prompt_ids=[1], billed_tokens=None)
    n = len(one(bad, prof, turn).output_ids)
    rb = one(bad, prof, replace(turn, billed_tokens=n))
    assert "structure_token_split" in rb.flags and rb.checks["structure_tokens_whole"] is False
    assert rb.proof_level == "text"


def test_roundtrip_failure_is_failed(qwen):
    text = ADVERSARIAL["combining"]  # Qwen's NFC normalizer composes it: the ids do not spell the text
    turn = ApiTurn("r", text, prompt_ids=[1], billed_tokens=None)
    rb = one(qwen, QWEN3, replace(turn, billed_tokens=len(one(qwen, QWEN3, turn).output_ids)))
    assert not rb.roundtrip_ok and rb.checks["ids_spell_text"] is False and rb.proof_level == "failed"


def test_drift_is_reported_per_proof_level(vocab):
    tok, prof = vocab
    word = " understanding"
    split = enc(tok, " under") + enc(tok, "standing")
    head = [prof.reasoning_open.id] + enc(tok, "ok") + [prof.reasoning_close.id]
    wrong = head + enc(tok, "Full") + split + [prof.end_of_turn.id]  # one token longer than the rebuild
    right = head + enc(tok, "Full" + word) + [prof.end_of_turn.id]
    recs = [dict(_exact_record(ids, i), usage={"completion_tokens": len(ids)}) for i, ids in enumerate([wrong, right])]
    recs.append(dict(_exact_record(right, 3), usage={}))
    dr = measure_drift(recs, tok, prof, dataset="d")
    assert dr.by_level == {"text": {"n": 2, "exact": 1}, "count": {"n": 1, "exact": 1}}


def test_run_writes_levels_calibration_and_tables(tmp_path, qwen):
    from eagle3data.core.params import load_params
    from eagle3data.rebuild.run import run_reconstruct
    from eagle3data.rebuild.proof import PROOF_LEVELS, FLAGS
    from runfiles import synthetic_api_record
    from eagle3data.core.records import Journal

    params = load_params("params/ci.yaml", {"output_root": str(tmp_path), "profile": "qwen3"})
    recs = []
    for i in range(12):
        turn = ApiTurn(f"\nStep {i}.\n", f"Answer {i}.", prompt_ids=[1, 2])
        n = len(one(qwen, QWEN3, turn).output_ids)
        recs.append(synthetic_api_record("b1_glaive", i, reasoning=turn.reasoning, content=turn.content,
                                         prompt_ids=[1, 2], completion_tokens=n - 1, provider="p"))
    recs.append(synthetic_api_record("b1_glaive", 50, reasoning="x", content="a\ufffdb", prompt_ids=[1, 2],
                                     completion_tokens=None, provider="q"))
    with Journal(params.run_dir / "records" / "b1_glaive.jsonl") as j:
        j.write_many(recs)
    res = run_reconstruct(params, progress=False, tokenizer=qwen)
    lines = [orjson_loads(x) for x in (params.run_dir / "reconstruct" / "b1_glaive.jsonl").read_bytes().splitlines()]
    assert all(ln["proof_level"] in PROOF_LEVELS and set(ln["flags"]) <= set(FLAGS) for ln in lines)
    assert [ln["proof_level"] for ln in lines] == ["count"] * 12 + ["text"]
    assert lines[0]["checks"]["count_on_offset"] is True and lines[0]["count_offset"] == 1
    cal = res.calibration_table()
    assert cal.loc[("p", "b1_glaive", "stop"), "count_offset"] == 1 and cal.loc[("p", "b1_glaive", "stop"), "calibrated"]
    lv = res.level_table()
    assert lv.loc[("b1_glaive", "p"), "count"] == 1.0 and lv.loc[("b1_glaive", "q"), "text"] == 1.0
    assert res.summary["datasets"]["b1_glaive"]["proof_levels"] == {"count": 12, "text": 1}
    assert res.table().loc["b1_glaive", "count_off_offset"] == 0
    assert res.drift_level_table().empty  # no exact records in this run


def orjson_loads(b):
    import orjson

    return orjson.loads(b)
