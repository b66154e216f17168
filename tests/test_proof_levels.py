"""02's proof levels: each wrong rebuild that used to pass is flagged or lowered to `text`, canonical records
stay at `count`, provider tokens give `token` records with the engine's ids, and calibration learns offsets.

Engine ids are built by hand so that they decode to exactly the text an API returns while
re-tokenizing that text gives other ids; all on the real Qwen3 vocabulary, and SmolLM2
(with a stand-in reasoning profile borrowing its added tokens) where the class applies.
"""

from __future__ import annotations

import sys
import unicodedata
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from eagle3data.core.params import ReconstructParams, load_params
from eagle3data.core.profiles import QWEN3, SMOLLM2
from eagle3data.rebuild.provider_tokens import span_ids
from eagle3data.rebuild.run import calibrate, measure_drift, reconstruct_records
from eagle3data.rebuild.assemble import ApiTurn, prompt_reasoning_state
from eagle3data.rebuild.proof import PROOF_LEVELS
from eagle3data.rebuild.text import rebuild_batch
from runfiles import logprob_entries, synthetic_api_record

sys.path.insert(0, str(Path(__file__).parent))
from runfiles import make_record, write_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

from runfiles import SMOL_REASONING  # noqa: E402
RESPLIT_TEXT = "Photosynthesis converts sunlight; mitochondria respire. We need HAVING clauses."
PLAIN = {
    "prose": "The answer is 42, because six times seven is forty-two.",
    "cjk": "这是一个测试。これはテストです。테스트입니다.",
    "emoji": "team 👩‍💻 👍🏽!",
    "code": "def f(x):\n\tfor i in range(x):\n\t\tprint(i)\n",
    "whitespace": "a" + " " * 40 + "b\n\n\n   \t \n",
}


@pytest.fixture(params=["qwen3", "smollm2"])
def vocab(request, smollm2_tokenizer, qwen):
    """(tokenizer, reasoning profile) on each vocabulary."""
    return (qwen, QWEN3) if request.param == "qwen3" else (smollm2_tokenizer, SMOL_REASONING)


def enc(tok, text):
    return tok.backend_tokenizer.encode(text, add_special_tokens=False).ids


def dec(tok, ids):
    return tok.backend_tokenizer.decode(list(ids), skip_special_tokens=False)


def one(tok, prof, turn, **kw):
    return rebuild_batch([turn], tok, prof, **kw)[0]


def _splits(bt, s: str, n: int):
    if n == 1:
        i = bt.token_to_id(s)
        if i is not None:
            yield [i]
        return
    for cut in range(1, len(s)):
        a = bt.token_to_id(s[:cut])
        if a is not None:
            for rest in _splits(bt, s[cut:], n - 1):
                yield [a] + rest


def same_count_resplit(tok, text: str) -> tuple[list[int], list[int]]:
    """(canonical ids, other ids of the same length that decode to the same text)."""
    bt = tok.backend_tokenizer
    ids = enc(tok, text)
    for w in (2, 3):
        for k in range(len(ids) - w + 1):
            for alt in _splits(bt, "".join(bt.id_to_token(i) for i in ids[k : k + w]), w):
                if alt != ids[k : k + w]:
                    out = ids[:k] + alt + ids[k + w:]
                    assert dec(tok, out) == text and len(out) == len(ids)
                    return ids, out
    raise AssertionError(f"no same-count resplit of {text!r}")


def byte_id(tok, b: int) -> int:
    """The id of the single-byte token for byte `b` (ByteLevel alphabet)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return tok.backend_tokenizer.token_to_id(bytes_to_unicode()[b])


def billed(tok, prof, turn) -> int:
    return len(one(tok, prof, replace(turn, billed_tokens=None, billed_reasoning_tokens=None)).output_ids)


# ---------------------------------------------------------------- canonical records: count, no flag


@pytest.mark.parametrize("name", list(PLAIN))
def test_canonical_records_stay_at_count_with_no_flag(vocab, name):
    tok, prof = vocab
    text = PLAIN[name]
    if unicodedata.normalize("NFC", text) != text:
        pytest.skip("normalizer changes it")
    reasoning = "\nLet me think about " + name + ".\n"
    turn = ApiTurn(reasoning, text, prompt_ids=[1, 2])
    n = billed(tok, prof, turn)
    rb = one(tok, prof, replace(turn, billed_tokens=n, billed_reasoning_tokens=len(enc(tok, reasoning))))
    assert rb.flags == [] and rb.proof_level == "count"
    assert rb.checks == {"ids_spell_text": True, "structure_tokens_whole": True, "count_on_offset": True,
                         "reasoning_count_on_offset": True, "spans_from_provider": []}


def test_no_billed_count_is_text_and_levels_are_ordered(vocab):
    tok, prof = vocab
    rb = one(tok, prof, ApiTurn("r", "c", prompt_ids=[1]))
    assert rb.proof_level == "text" and rb.checks["count_on_offset"] is None
    assert PROOF_LEVELS == ("failed", "text", "count", "token", "engine")


# ---------------------------------------------------------------- class 1: same-count resplits


def test_same_count_resplit_stays_count_but_provider_tokens_give_the_engine_ids(vocab):
    """Re-tokenizing cannot see a same-count resplit (it stays `count`, and drift-by-level counts it);
    the provider's own tokens (a whole-output logprobs list, as some engines return) give the engine's ids."""
    tok, prof = vocab
    canon_r, alt_r = same_count_resplit(tok, RESPLIT_TEXT)
    canon_c, alt_c = same_count_resplit(tok, " " + RESPLIT_TEXT)
    engine = [prof.reasoning_open.id] + alt_r + [prof.reasoning_close.id] + alt_c + [prof.end_of_turn.id]
    turn = ApiTurn(dec(tok, alt_r), dec(tok, alt_c), prompt_ids=[1], billed_tokens=len(engine),
                   billed_reasoning_tokens=len(alt_r))
    rb = one(tok, prof, turn)
    assert rb.output_ids != engine and len(rb.output_ids) == len(engine)
    assert rb.proof_level == "count"  # what `count` cannot prove (documented; measured by drift per level)
    rec = {"dataset": "d", "sample_id": 1, "output_ids": engine, "prompt_ids": [1], "finish_reason": "stop",
           "usage": {"completion_tokens": len(engine)}}
    dr = measure_drift([rec], tok, prof, dataset="d")
    assert dr.by_level == {"count": {"n": 1, "exact": 0}}

    lp = {"content": logprob_entries(engine, tok), "refusal": None}  # reasoning, close and end-of-turn included
    rt = one(tok, prof, replace(turn, logprobs=lp))
    assert rt.output_ids == engine and rt.proof_level == "token"
    assert rt.token_exact_spans == ["content", "reasoning"] and rt.flags == []


def test_content_logprobs_give_token_records_on_a_non_reasoning_profile(smollm2_tokenizer):
    tok = smollm2_tokenizer
    _, alt = same_count_resplit(tok, RESPLIT_TEXT)
    engine = alt + [SMOLLM2.end_of_turn.id]
    for with_bytes in (True, False):  # bytes where given, else the token text through the byte alphabet
        lp = {"content": logprob_entries(alt, tok, with_bytes=with_bytes), "refusal": None}
        rb = one(tok, SMOLLM2, ApiTurn(None, dec(tok, alt), prompt_ids=[1], billed_tokens=len(engine), logprobs=lp))
        assert rb.output_ids == engine and rb.proof_level == "token" and rb.token_exact_spans == ["content"]
        assert rb.output_ids != one(tok, SMOLLM2, ApiTurn(None, dec(tok, alt), prompt_ids=[1])).output_ids


def test_content_only_logprobs_on_a_reasoning_turn_mark_only_the_content(vocab):
    """OpenAI/OpenRouter return no per-token list for reasoning: the content is token-exact, the record is not `token`."""
    tok, prof = vocab
    _, alt_c = same_count_resplit(tok, " " + RESPLIT_TEXT)
    reasoning = "\nThinking.\n"
    engine = [prof.reasoning_open.id] + enc(tok, reasoning) + [prof.reasoning_close.id] + alt_c + [prof.end_of_turn.id]
    lp = {"content": logprob_entries(alt_c, tok)}
    rb = one(tok, prof, ApiTurn(reasoning, dec(tok, alt_c), prompt_ids=[1], billed_tokens=len(engine), logprobs=lp))
    assert rb.output_ids == engine and rb.token_exact_spans == ["content"] and rb.proof_level == "count"


def test_unusable_provider_tokens_fall_back_to_the_rebuild(vocab):
    tok, prof = vocab
    content = " hello world"
    lp = {"content": [{"token": " hello", "bytes": list(b" hello")}, {"token": " moon", "bytes": list(b" moon")}]}
    rb = one(tok, prof, ApiTurn("r", content, prompt_ids=[1], logprobs=lp))
    assert "provider_tokens_unusable" in rb.flags and rb.token_exact_spans == []
    assert rb.output_ids == one(tok, prof, ApiTurn("r", content, prompt_ids=[1])).output_ids
    unmapped = {"content": [{"token": "\ufffd", "bytes": None}]}
    assert span_ids(unmapped, "r", content, prof, tok).problem


# ---------------------------------------------------------------- class 2: bytes that are not UTF-8


def test_stray_byte_shows_as_replacement_char_and_is_lowered(vocab):
    tok, prof = vocab
    c_ids = enc(tok, "abc") + [byte_id(tok, 0x80)] + enc(tok, " def")
    content = dec(tok, c_ids)
    assert "\ufffd" in content
    engine = [prof.reasoning_open.id] + enc(tok, "r") + [prof.reasoning_close.id] + c_ids + [prof.end_of_turn.id]
    turn = ApiTurn("r", content, prompt_ids=[1], billed_tokens=len(engine))
    rb = one(tok, prof, turn)
    assert rb.output_ids != engine
    assert "content_has_replacement_char" in rb.flags and rb.proof_level == "text"
    r2 = one(tok, prof, ApiTurn(content, "ok", prompt_ids=[1], billed_tokens=billed(tok, prof, turn)))
    assert "reasoning_has_replacement_char" in r2.flags and r2.proof_level == "text"


def test_stray_byte_with_provider_bytes_is_token_exact(smollm2_tokenizer):
    tok = smollm2_tokenizer
    c_ids = enc(tok, "abc") + [byte_id(tok, 0x80)] + enc(tok, " def")
    lp = {"content": logprob_entries(c_ids, tok)}
    assert lp["content"][len(enc(tok, "abc"))]["token"] == "\ufffd"  # the text lost the byte; `bytes` keeps it
    rb = one(tok, SMOLLM2, ApiTurn(None, dec(tok, c_ids), prompt_ids=[1], billed_tokens=len(c_ids) + 1, logprobs=lp))
    assert rb.output_ids == c_ids + [SMOLLM2.end_of_turn.id] and rb.proof_level == "token"


def test_character_cut_by_length_held_back_is_caught_by_the_count(vocab):
    tok, prof = vocab
    euro = "€".encode()
    c_ids = enc(tok, "price:") + [byte_id(tok, euro[0])]  # cut after the first byte of a 3-byte character
    engine = [prof.reasoning_open.id] + enc(tok, "r") + [prof.reasoning_close.id] + c_ids
    held_back = one(tok, prof, ApiTurn("r", "price:", finish_reason="length", prompt_ids=[1], billed_tokens=len(engine)))
    assert held_back.count_diff == -1 and "count_off_offset" in held_back.flags and held_back.proof_level == "text"
    shown = one(tok, prof, ApiTurn("r", dec(tok, c_ids), finish_reason="length", prompt_ids=[1],
                                   billed_tokens=len(engine)))
    assert "content_has_replacement_char" in shown.flags and shown.proof_level == "text"


# ---------------------------------------------------------------- class 3: ±1 inside the old 2% tolerance


@pytest.mark.parametrize("delta", [-1, 1])
def test_one_token_off_inside_the_old_tolerance_is_flagged(vocab, delta):
    tok, prof = vocab
    turn = ApiTurn("\n" + " ".join(["we check each case"] * 40) + "\n", "The answer is 7.", prompt_ids=[1])
    n = billed(tok, prof, turn)
    assert n > 100
    rb = one(tok, prof, replace(turn, billed_tokens=n + delta))
    assert "count_outside_tolerance" not in rb.flags  # what passed before
    assert "count_off_offset" in rb.flags and rb.proof_level == "text"


# ---------------------------------------------------------------- class 4: a length cut right after the close


def test_length_cut_right_after_the_reasoning_close_keeps_the_close(vocab):
    tok, prof = vocab
    reasoning = "\nSo the result is eleven.\n"
    r_ids = enc(tok, reasoning)
    engine = [prof.reasoning_open.id] + r_ids + [prof.reasoning_close.id]  # max_new_tokens hit right after </think>
    turn = ApiTurn(reasoning, "", finish_reason="length", prompt_ids=[1], billed_tokens=len(engine),
                   billed_reasoning_tokens=len(r_ids))
    rb = one(tok, prof, turn)
    assert rb.output_ids == engine and "length_cut_after_reasoning" in rb.flags
    assert "truncated_in_reasoning" not in rb.flags and rb.proof_level == "count"
    blind = one(tok, prof, replace(turn, billed_reasoning_tokens=None))  # no billed reasoning: cannot be placed
    assert blind.output_ids == engine[:-1] and "count_off_offset" in blind.flags and blind.proof_level == "text"
    inside = [prof.reasoning_open.id] + r_ids  # a real cut inside the reasoning stays there
    ri = one(tok, prof, replace(turn, billed_tokens=len(inside)))
    assert ri.output_ids == inside and "truncated_in_reasoning" in ri.flags and ri.proof_level == "count"


def test_length_cut_placed_by_whole_output_provider_tokens(qwen):
    reasoning = "\nSo the result is eleven.\n"
    engine = [QWEN3.reasoning_open.id] + enc(qwen, reasoning) + [QWEN3.reasoning_close.id]
    rb = one(qwen, QWEN3, ApiTurn(reasoning, "", finish_reason="length", prompt_ids=[1], billed_tokens=len(engine),
                                  logprobs={"content": logprob_entries(engine, qwen)}))
    assert rb.output_ids == engine and rb.proof_level == "token" and "length_cut_after_reasoning" in rb.flags


# ---------------------------------------------------------------- class 5: literal text of any added token


def _spelled_as_text(tok, literal: str) -> list[int]:
    """Ids that spell `literal` as ordinary text (no added token): what a model may emit."""
    return enc(tok, literal[:1]) + enc(tok, literal[1:-1]) + enc(tok, literal[-1:])


@pytest.mark.parametrize("field", ["content", "reasoning"])
@pytest.mark.parametrize("literal", ["<|im_start|>", "<|endoftext|>", "<tool_response>", "<|fim_prefix|>",
                                     "<|file_sep|>", "<|vision_pad|>"])
def test_added_token_text_in_the_api_text_is_flagged_qwen3(qwen, literal, field):
    text = f"Write {literal} there."
    spelled = enc(qwen, "Write ") + _spelled_as_text(qwen, literal) + enc(qwen, " there.")
    assert dec(qwen, spelled) == text
    turn = ApiTurn(text if field == "reasoning" else "r", text if field == "content" else "c", prompt_ids=[1])
    rb = one(qwen, QWEN3, replace(turn, billed_tokens=billed(qwen, QWEN3, turn)))
    assert f"{field}_has_added_token_text" in rb.flags and rb.proof_level == "text"


@pytest.mark.parametrize("literal", ["<|im_start|>", "<filename>", "<gh_stars>", "<empty_output>"])
def test_added_token_text_in_the_api_text_is_flagged_smollm2(smollm2_tokenizer, literal):
    tok = smollm2_tokenizer
    turn = ApiTurn(None, f"see {literal} here", prompt_ids=[1])
    rb = one(tok, SMOLLM2, replace(turn, billed_tokens=billed(tok, SMOLLM2, turn)))
    assert "content_has_added_token_text" in rb.flags and rb.proof_level == "text"


def test_profile_markers_in_the_text_lower_the_level_too(vocab):
    tok, prof = vocab
    turn = ApiTurn("r", "print('" + prof.end_of_turn.text + "')", prompt_ids=[1])
    rb = one(tok, prof, replace(turn, billed_tokens=billed(tok, prof, turn)))
    assert "content_has_end_of_turn" in rb.flags and rb.proof_level == "text"


# ---------------------------------------------------------------- class 6: the prompt already closed reasoning


def _thinking_off_prompt(qwen) -> list[int]:
    text = qwen.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                    tokenize=False, enable_thinking=False)
    ids = enc(qwen, text)
    assert dec(qwen, ids).endswith("<think>\n\n</think>\n\n")
    return ids


def test_no_reasoning_block_after_a_prompt_that_closed_reasoning(qwen):
    prompt = _thinking_off_prompt(qwen)
    assert prompt_reasoning_state(prompt, QWEN3) == "closed"
    engine = enc(qwen, "Hello!") + [QWEN3.end_of_turn.id]
    rb = one(qwen, QWEN3, ApiTurn(None, "Hello!", prompt_ids=prompt, billed_tokens=len(engine)))
    assert rb.output_ids == engine and rb.flags == ["prompt_closed_reasoning"] and rb.proof_level == "count"
    also = one(qwen, QWEN3, ApiTurn("", "Hello!", prompt_ids=prompt, billed_tokens=len(engine)))
    assert also.output_ids == engine and "empty_reasoning" not in also.flags
    odd = one(qwen, QWEN3, ApiTurn("I think.", "Hello!", prompt_ids=prompt))
    assert "reasoning_after_closed_prompt" in odd.flags and odd.proof_level == "text"
    assert QWEN3.reasoning_open.id not in odd.output_ids and QWEN3.reasoning_close.id not in odd.output_ids
    lp = {"content": logprob_entries(engine[:-1], qwen)}  # content-only logprobs suffice here: no reasoning span
    tok_rb = one(qwen, QWEN3, ApiTurn(None, "Hello!", prompt_ids=prompt, billed_tokens=len(engine), logprobs=lp))
    assert tok_rb.proof_level == "token" and tok_rb.output_ids == engine


def test_prompt_reasoning_states(vocab):
    tok, prof = vocab
    ro, rc, eot = prof.reasoning_open.id, prof.reasoning_close.id, prof.end_of_turn.id
    assert prompt_reasoning_state([5, eot, 6, ro], prof) == "open"
    assert prompt_reasoning_state([5, eot, 6, ro, 7], prof) == "open"  # e.g. a template ending "<think>\n"
    assert prompt_reasoning_state([5, eot, 6, ro, 7, rc, 7], prof) == "closed"
    assert prompt_reasoning_state([ro, 7, rc, eot, 6], prof) is None  # an earlier turn's reasoning
    rb = one(tok, prof, ApiTurn("r", "c", prompt_ids=[5, eot, 6, ro, enc(tok, "\n")[0]]))
    assert rb.output_ids[0] != ro


# ---------------------------------------------------------------- calibration


def _records(tok, prof, n, provider, over_billed, start=0):
    recs = []
    for i in range(start, start + n):
        turn = ApiTurn(f"\nStep {i}: check the case.\n", f"The answer is {i}.", prompt_ids=[1, 2])
        rebuilt = billed(tok, prof, turn)
        recs.append(synthetic_api_record("d", i, reasoning=turn.reasoning, content=turn.content, prompt_ids=[1, 2],
                                         completion_tokens=rebuilt - over_billed, provider=provider,
                                         profile=prof.name))
    return recs


def test_calibration_learns_a_plus_one_end_of_turn_offset_and_flags_a_record_off_it(vocab):
    tok, prof = vocab
    recs = _records(tok, prof, 12, "no-eot-billed", 1)  # the provider does not bill the end-of-turn
    off = _records(tok, prof, 1, "no-eot-billed", 0, start=100)  # one record a token longer than the others say
    small = _records(tok, prof, 3, "exact-billing", 0, start=200)  # too few to calibrate: offset 0
    cal: list = []
    lines = reconstruct_records(recs + off + small, tok, prof, ReconstructParams(), cal)
    rows = {r["provider"]: r for r in cal}
    assert rows["no-eot-billed"]["count_offset"] == 1 and rows["no-eot-billed"]["calibrated"]
    assert rows["no-eot-billed"]["off_offset"] == 1 and rows["no-eot-billed"]["records"] == 13
    assert rows["exact-billing"]["count_offset"] == 0 and not rows["exact-billing"]["calibrated"]
    by = {ln["sample_id"]: ln for ln in lines}
    for i in range(12):
        assert by[i]["proof_level"] == "count" and by[i]["flags"] == [] and by[i]["count_offset"] == 1
    assert by[100]["proof_level"] == "text" and "count_off_offset" in by[100]["flags"]
    assert all(by[i]["proof_level"] == "count" for i in range(200, 203))


def test_calibration_refuses_a_scattered_or_large_offset(qwen):
    from eagle3data.rebuild.proof import Rebuilt

    def rb(d):
        return Rebuilt([1], "x", [], True, None, True, 10, d)

    scattered = [rb(d) for d in [0, 1, 2, 3, -1, -2] * 3]
    large = [rb(9) for _ in range(12)]
    cal = calibrate({("p", "d", "stop"): scattered, ("q", "d", "stop"): large})
    assert [(r["calibrated"], r["count_offset"]) for r in cal] == [(False, 0), (False, 0)]
    assert sum(x.proof_level == "count" for x in scattered) == 3 and all(x.proof_level == "text" for x in large)


def test_billed_reasoning_tokens_are_checked_against_the_reasoning_span(vocab):
    tok, prof = vocab
    reasoning = "\nWe compare the result with the expected bound.\n"
    turn = ApiTurn(reasoning, "Done.", prompt_ids=[1])
    n, nr = billed(tok, prof, turn), len(enc(tok, reasoning))
    good = one(tok, prof, replace(turn, billed_tokens=n, billed_reasoning_tokens=nr))
    assert good.reasoning_rebuilt == nr and good.proof_level == "count"
    bad = one(tok, prof, replace(turn, billed_tokens=n, billed_reasoning_tokens=nr + 1))
    assert "reasoning_count_off_offset" in bad.flags and bad.proof_level == "text"


# ---------------------------------------------------------------- the run: loopback logprobs, mix, audit meta


def test_loopback_logprobs_become_token_records(tmp_path, smollm2_tokenizer, monkeypatch):
    from eagle3data.generate.run import run_generate
    from eagle3data.rebuild.run import run_reconstruct
    from loopback import LoopbackServer
    from test_generate_http import KEY_ENV, make_params

    monkeypatch.setenv(KEY_ENV, "sk-loopback")
    tok = smollm2_tokenizer
    _, alt = same_count_resplit(tok, RESPLIT_TEXT)

    def script(req):
        return {"reasoning": None, "content": dec(tok, alt), "completion_tokens": len(alt) + 1,
                "reasoning_tokens": 0, "logprobs": {"content": logprob_entries(alt, tok), "refusal": None}}

    with LoopbackServer("openai") as srv:
        srv.chat_script = script
        params = make_params(tmp_path, srv, n=6, **{"generate.openai.logprobs": True,
                                                    "generate.openai.top_logprobs": 2})
        run_generate(params, progress=False, tokenizer=tok)
        bodies = [r["body"] for r in srv.requests if r["path"] == "/chat/completions"]
    assert bodies and all(b["logprobs"] is True and b["top_logprobs"] == 2 for b in bodies)
    assert all(b["provider"]["require_parameters"] is True for b in bodies)
    recs = [orjson.loads(x) for x in (params.run_dir / "records" / "d0.jsonl").read_bytes().splitlines()]
    assert all(r["logprobs"]["content"][0]["bytes"] for r in recs)
    res = run_reconstruct(params, progress=False, tokenizer=tok)
    lines = [orjson.loads(x) for x in (params.run_dir / "reconstruct" / "d0.jsonl").read_bytes().splitlines()]
    no_tools = [ln for ln in lines if int(ln["sample_id"]) % 4]  # the loopback adds a tool call to every 4th
    assert no_tools and all(ln["proof_level"] == "token" and ln["output_ids"] == alt + [SMOLLM2.end_of_turn.id]
                            for ln in no_tools)
    assert all(ln["proof_level"] != "token" for ln in lines if int(ln["sample_id"]) % 4 == 0)
    assert res.level_table().loc[("d0", "Loopback-int4"), "token"] == pytest.approx(len(no_tools) / len(lines))


def test_logprobs_params_need_require_parameters():
    from eagle3data.core.params import OpenAIParams

    with pytest.raises(ValueError, match="require_parameters"):
        OpenAIParams(base_url="http://x", model="m", logprobs=True, provider={"require_parameters": False})
    with pytest.raises(ValueError, match="top_logprobs needs"):
        OpenAIParams(base_url="http://x", model="m", top_logprobs=3)


def _run_with_levels(tmp_path, **over):
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), **over})
    rd = p.run_dir
    write_jsonl(rd / "records" / "b1_glaive.jsonl", [
        make_record("b1_glaive", 1, output=(10, 11, 2)),
        *(make_record("b1_glaive", i, output=None, source="api") for i in (2, 3, 4, 5)),
    ])
    rebuilt = [{"dataset": "b1_glaive", "sample_id": i, "source": "api", "ids_exact": False,
                "input_ids": [1, 2, 3, 40 + i, 2], "loss_mask": [0, 0, 0, 1, 1], "output_ids": [40 + i, 2],
                "prompt_ids": [1, 2, 3], **({"proof_level": lv} if lv else {})}
               for i, lv in ((2, "count"), (3, "text"), (4, "token"), (5, None))]
    write_jsonl(rd / "reconstruct" / "b1_glaive.jsonl", rebuilt)
    return p


def test_mix_takes_a_minimum_proof_level(tmp_path):
    from eagle3data.hidden.mix import DROP_REASONS, build_mix

    assert list(DROP_REASONS).index("proof_too_low") == list(DROP_REASONS).index("audit_failed") + 1
    mix = build_mix(_run_with_levels(tmp_path / "a"), write=False)
    assert {s.key for s in mix.samples} == {"b1_glaive/1", "b1_glaive/2", "b1_glaive/4", "b1_glaive/5"}
    assert [(d["sample_id"], d["reason"], d["proof_level"]) for d in mix.dropped] == [("3", "proof_too_low", "text")]
    assert mix.manifest["settings"]["min_proof_level"] == "count"
    strict = build_mix(_run_with_levels(tmp_path / "b", **{"hidden.min_proof_level": "token"}), write=False)
    assert {s.key for s in strict.samples} == {"b1_glaive/1", "b1_glaive/4", "b1_glaive/5"}
    loose = build_mix(_run_with_levels(tmp_path / "c", **{"hidden.min_proof_level": "text"}), write=False)
    assert len(loose.samples) == 5 and not loose.dropped


def test_audit_meta_shows_the_proof_level(tmp_path):
    from eagle3data.audit.runtable import load_run

    p = _run_with_levels(tmp_path)
    t = load_run(p.run_dir)
    got = dict(zip(t.meta["sample_id"].astype(str), t.meta["proof_level"]))
    assert got == {"1": "engine", "2": "count", "3": "text", "4": "token", "5": "unknown"}


def test_reasoning_counts_zero_or_scattered_are_not_used(qwen):
    from eagle3data.rebuild.proof import Rebuilt

    turn = ApiTurn("\nSome reasoning here.\n", "Done.", prompt_ids=[1])
    n = billed(qwen, QWEN3, turn)
    zero = one(qwen, QWEN3, replace(turn, billed_tokens=n, billed_reasoning_tokens=0))  # "not counted", not 0 tokens
    assert zero.reasoning_diff is None and zero.proof_level == "count"

    def rb(rd):
        return Rebuilt([1], "x", [], True, None, True, 10, 0, reasoning_diff=rd)

    scattered = [rb(d) for d in [0, 4, 9, -5, 2, 7] * 2]
    cal = calibrate({("p", "d", "stop"): scattered})
    assert cal[0]["reasoning_offset"] is None and not cal[0]["reasoning_calibrated"]
    assert all(x.proof_level == "count" and x.checks["reasoning_count_on_offset"] is None for x in scattered)


def test_sweep_one_token_resplits_are_all_flagged(qwen):
    """Every split of one token into two (the text unchanged, one token more) is caught by the exact count."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    bt = qwen.backend_tokenizer
    text = "Photosynthesis converts sunlight into chemical energy, which mitochondria later release."
    ids = enc(qwen, text)
    caught = tried = 0
    for k, i in enumerate(ids):
        piece = bt.id_to_token(i)
        for cut in range(1, len(piece)):
            a, b = bt.token_to_id(piece[:cut]), bt.token_to_id(piece[cut:])
            if a is None or b is None:
                continue
            c_ids = ids[:k] + [a, b] + ids[k + 1:]
            engine = [QWEN3.reasoning_open.id] + enc(qwen, "r") + [QWEN3.reasoning_close.id] + c_ids + [151645]
            rb = one(qwen, QWEN3, ApiTurn("r", dec(qwen, c_ids), prompt_ids=[1], billed_tokens=len(engine)))
            tried += 1
            caught += rb.proof_level == "text" and "count_off_offset" in rb.flags and rb.output_ids != engine
            break
    assert tried >= 8 and caught == tried
    assert bytes_to_unicode()[32] == "Ġ"  # the alphabet the pieces are spelled in
