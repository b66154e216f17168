"""`text_rule`'s rows (issue 60): what a text-only trainer trains on, against a reading of TorchSpec's own code.

Each fixture is a row of a real shape (a reply cut at the token budget, a tool call with and without its result in
the history, a multi-turn conversation, a plain stop reply), made from the format fixtures as a record with exact
ids. `_torchspec_reading` restates, independently of `value/text_rule.py`, what TorchSpec's
`torchspec/data/parse.py::GeneralParser.parse` → `Parser._tokenize_with_loss_mask` does with its registry's `qwen`
entry (`torchspec/data/template.py`): the conversation rendered by the tokenizer's own template, encoded without
special tokens; each span from after `<|im_start|>assistant\\n` to the end of the first `<|im_end|>\\n` after it (or
the text's end); a span's tokens from the token count of the text up to its start to the count up to its end.
TorchSpec is not installable (its PyPI name is a placeholder): its code was read, not run here.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from runfiles import make_record  # noqa: E402

from eagle3data.core.profiles import get_profile
from eagle3data.core.reader import resolve
from eagle3data.export.text_drift import DriftCount, rule_ids, text_drift
from eagle3data.prompts.load import Prompt, load_prompts, messages_for_template, template_prompt
from eagle3data.value.peer_rows import KINDS
from eagle3data.value.text_rule import text_rule_rows

FORMATS = Path(__file__).parent / "fixtures" / "formats"
SMOL = get_profile("smollm2")
HEADER, END = "<|im_start|>assistant\n", "<|im_end|>\n"  # TorchSpec's `qwen` entry


def _conversation(fmt: str, file: str, n: int) -> tuple[list[dict], list | None]:
    p = load_prompts(FORMATS / file, format=fmt).prompts[n]
    return [dict(m) for m in (p.conversation or p.messages)], p.tools


def _sample(tok, profile, sid: str, messages: list[dict], output_text: str, *, tools=None, content=None,
            tool_calls=None, reasoning=None, finish_reason: str = "stop", output_ids=None):
    """A local record's sample: the template's prompt ids, then the output's ids (and its end-of-turn at a stop)."""
    prompt_ids = template_prompt(tok, Prompt("d", sid, messages, tools), profile)
    out = list(output_ids) if output_ids is not None else tok.encode(output_text, add_special_tokens=False)
    if finish_reason != "length":
        out.append(profile.end_of_turn.id)
    rec = make_record("d", sid, prompt_ids, out, profile=profile.name, messages=messages, tools=tools,
                      finish_reason=finish_reason, content=output_text if content is None else content,
                      tool_calls=tool_calls, reasoning=reasoning)
    return resolve(rec, {}, keep_record=True)


def _rendered(tok, profile, s) -> str:
    """The conversation as text: the record's messages and its reply as the last assistant turn."""
    rec = s.record
    reply = {"role": "assistant", "content": rec["content"] or "", "reasoning_content": rec.get("reasoning") or ""}
    if rec.get("tool_calls"):
        reply["tool_calls"] = rec["tool_calls"]
    msgs, tools = messages_for_template(Prompt("d", s.sample_id, [*rec["messages"], reply], rec.get("tools")), profile)
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **profile.template_kwargs,
                                   **({"tools": tools} if tools else {}))


def _torchspec_reading(tok, text: str, last_turn_only: bool = False) -> tuple[list[int], list[int]]:
    """TorchSpec's ids and mask for a rendered ChatML conversation (module docstring), with str.find, not a regex."""
    def count(t: str) -> int:
        return len(tok(t, add_special_tokens=False)["input_ids"])

    ids = tok(text, add_special_tokens=False)["input_ids"]
    spans, pos = [], 0
    while (h := text.find(HEADER, pos)) >= 0:
        start = h + len(HEADER)
        e = text.find(END, start)
        pos = len(text) if e < 0 else e + len(END)
        spans.append((start, pos))
    mask = [0] * len(ids)
    for start, stop in spans[-1:] if last_turn_only else spans:
        for i in range(min(count(text[:start]), len(ids)), min(count(text[:stop]), len(ids))):
            mask[i] = 1
    # the same spans read through the fast tokenizer's offsets (tokens overlapping them) agree on these fixtures
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert mask == [int(any(a < stop and b > start for start, stop in (spans[-1:] if last_turn_only else spans)))
                    for a, b in offsets]
    return ids, mask


def _supervised(tok, row) -> list[str]:
    """The supervised runs of a row, decoded."""
    runs, cur = [], []
    for i, m in zip(row.input_ids, row.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return [tok.decode(r, skip_special_tokens=False) for r in [*runs, *([cur] if cur else [])]]


def _check(tok, profile, samples, rows, *, last_turn_only: bool = False) -> None:
    """The rows are `rule_ids`' ids with TorchSpec's mask (0/1, as long as the ids); each row's kind is DriftCount's."""
    assert [r.key for r in rows] == [s.key for s in samples]
    assert [r.input_ids for r in rows] == rule_ids(tok, samples, profile)
    for s, r in zip(samples, rows):
        assert (r.input_ids, r.loss_mask) == _torchspec_reading(tok, _rendered(tok, profile, s), last_turn_only)
        assert len(r.loss_mask) == len(r.input_ids) and set(r.loss_mask) <= {0, 1} and r.kind in KINDS
    count = DriftCount(tok, profile)
    count.add(samples)
    got = count.result()
    kinds = Counter(r.kind for r in rows)
    assert (got["equal"], got["equal_then_template_tail"]) == (kinds["equal"], kinds["equal_then_template_tail"])
    reproduced = ("equal", "equal_then_template_tail")
    assert got["differ_kinds"] == {k: v for k, v in sorted(kinds.items()) if k not in reproduced}
    assert got["differing_keys"] == [str(r.key) for r in rows if r.kind not in reproduced]


def test_a_reply_cut_at_the_budget_gets_an_end_of_turn_and_torchspec_trains_it(smollm2_tokenizer):
    tok = smollm2_tokenizer
    msgs, _ = _conversation("ultrachat", "ultrachat_200k.jsonl", 0)
    cut = tok.encode(msgs[1]["content"], add_special_tokens=False)[:12]  # the target's output at a 12-token budget
    s = _sample(tok, SMOL, "cut", msgs[:1], tok.decode(cut), output_ids=cut, finish_reason="length")
    [row] = text_rule_rows(tok, SMOL, [s])
    _check(tok, SMOL, [s], [row])
    n = len(s.input_ids)
    assert row.kind == "end_of_turn_added" and row.input_ids[:n] == s.input_ids
    assert row.input_ids[n] == SMOL.end_of_turn.id and row.loss_mask[n] == 1  # the end-of-turn never emitted: trained
    assert row.loss_mask[:n] == s.loss_mask and row.loss_mask[n:] == [1, 1]  # ... and the template's newline after it
    assert _supervised(tok, row) == [tok.decode(cut) + END]


def test_a_tool_call_is_trained_as_its_json_and_a_tool_result_is_not(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv, tools = _conversation("glaive", "glaive_function_calling_v2.json", 0)
    assert [m["role"] for m in conv[:5]] == ["system", "user", "assistant", "tool", "assistant"] and tools
    call = conv[2]["tool_calls"]
    call_json = '{"name": "get_weather", "arguments": {"city": "Lisbon"}}'  # what messages_for_template renders
    first = _sample(tok, SMOL, "call", conv[:2], call_json, tools=tools, content="", tool_calls=call,
                    finish_reason="tool_calls")
    after = _sample(tok, SMOL, "after", conv[:4], conv[4]["content"], tools=tools)
    rows = text_rule_rows(tok, SMOL, [first, after])
    _check(tok, SMOL, [first, after], rows)
    assert _supervised(tok, rows[0]) == [call_json + END]
    # the earlier call is an assistant turn: trained again in the next row; the tool's result and the tools' system
    # text are not
    assert _supervised(tok, rows[1]) == [call_json + END, conv[4]["content"] + END]
    assert all(r.kind == "equal_then_template_tail" for r in rows)


def test_every_assistant_turn_of_a_multi_turn_conversation_is_trained(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv, _ = _conversation("sharegpt", "sharegpt.json", 0)
    assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
    s = _sample(tok, SMOL, "multi", conv[:3], conv[3]["content"])
    [row] = text_rule_rows(tok, SMOL, [s])
    _check(tok, SMOL, [s], [row])
    assert _supervised(tok, row) == [conv[1]["content"] + END, conv[3]["content"] + END]
    assert sum(row.loss_mask) > sum(s.loss_mask) + 1  # more than our reply: the history's reply is trained too


def test_a_plain_stop_reply_is_ours_then_the_templates_newline(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv, _ = _conversation("sharegpt", "sharegpt.json", 1)
    assert [m["role"] for m in conv] == ["system", "user", "assistant"]
    s = _sample(tok, SMOL, "stop", conv[:2], conv[2]["content"])
    [row] = text_rule_rows(tok, SMOL, [s])
    _check(tok, SMOL, [s], [row])
    n = len(s.input_ids)
    assert row.kind in ("equal", "equal_then_template_tail")
    assert row.input_ids[:n] == s.input_ids and row.loss_mask[:n] == s.loss_mask  # our reply and end-of-turn ...
    assert row.loss_mask[n:] == [1] * (len(row.input_ids) - n)  # ... and the template's newline after it


def test_model_optimizers_default_trains_every_token_and_kinds_are_one_truth(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv, _ = _conversation("sharegpt", "sharegpt.json", 0)
    samples = [_sample(tok, SMOL, "a", conv[:1], conv[1]["content"]),
               _sample(tok, SMOL, "b", conv[:3], conv[3]["content"]),
               _sample(tok, SMOL, "c", conv[:1], "Try", output_ids=tok.encode("Try", add_special_tokens=False),
                       finish_reason="length")]
    ts, mo = text_rule_rows(tok, SMOL, samples), text_rule_rows(tok, SMOL, samples, peer="modelopt")
    assert [r.input_ids for r in mo] == [r.input_ids for r in ts] and all(set(r.loss_mask) == {1} for r in mo)
    assert [r.kind for r in mo] == [r.kind for r in ts]
    d = text_drift(samples, tok, SMOL)  # 05's count, chunked, on the same rows
    assert d["reproduced"] == sum(r.kind in ("equal", "equal_then_template_tail") for r in ts)
    assert d["differ_kinds"] == {"end_of_turn_added": 1}
    with pytest.raises(ValueError, match="unknown peer"):
        text_rule_rows(tok, SMOL, samples, peer="specforge")
    with pytest.raises(ValueError, match="record"):
        text_rule_rows(tok, SMOL, [type(samples[0])(**{**samples[0].__dict__, "record": None})])


def test_with_thinking_only_the_last_turn_is_trained(qwen):
    """TorchSpec's `last_turn_loss_only: auto`: a conversation with reasoning trains its last assistant turn only."""
    prof = get_profile("qwen3")
    conv, _ = _conversation("sharegpt", "sharegpt.json", 0)
    reply = "<think>\nShort and tense.\n</think>\n\n" + conv[3]["content"]
    s = _sample(qwen, prof, "think", conv[:3], reply, content=conv[3]["content"], reasoning="Short and tense.")
    plain = _sample(qwen, prof, "plain", conv[:3], conv[3]["content"])
    think_row, plain_row = text_rule_rows(qwen, prof, [s, plain])
    _check(qwen, prof, [s], [think_row], last_turn_only=True)
    _check(qwen, prof, [plain], [plain_row])
    assert _supervised(qwen, think_row) == [conv[3]["content"] + END]
    # the tests' Qwen3-style template renders no reasoning_content: the text has no think block where ours has one
    assert think_row.kind == "inside"
    assert _supervised(qwen, plain_row) == [conv[1]["content"] + END, conv[3]["content"] + END]
