"""Tool-call records from the exact backends (local, SGLang) keep their text fields equal to the one
split of their ids, so they pass 03's `text.fields_match` and reach the export — on the real Qwen3
vocabulary and on the Kimi profile (the tests' stand-in vocabulary at Kimi's ids).

Before the one split (`Profile.split_output`), the local and SGLang backends wrote the tool-call
section into `content` while the audit stripped it: every such record failed and dropped out.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from eagle3data.audit.run import run_audit
from eagle3data.export.run import select_samples
from eagle3data.generate.run import run_generate
from eagle3data.core.params import load_params
from eagle3data.core.profiles import KIMI_K25, QWEN3
from eagle3data.core.records import scan_journal
from loopback import LoopbackServer
from scripted_lm import ScriptedLM

REPO = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def kimi():
    from synthetic import SyntheticTokenizer

    return SyntheticTokenizer(KIMI_K25)


def enc(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _day(tok, prompt_ids) -> str:
    """The day a prompt asks about (each prompt gets its own output: identical outputs would be flagged)."""
    return tok.decode(list(prompt_ids)).rsplit("day ", 1)[1][0]


def qwen_tool_output(tok, prompt_ids) -> list[int]:
    """What Qwen3 emits for a tool call: thinking, a short answer, one native call, end of turn."""
    p = QWEN3
    return ([p.reasoning_open.id] + enc(tok, f"\nThe user wants the weather of day {_day(tok, prompt_ids)}.\n")
            + [p.reasoning_close.id] + enc(tok, "\n\nLet me check that.\n") + [p.tool_calls.call_begin.id]
            + enc(tok, '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n') + [p.tool_calls.call_end.id]
            + [p.end_of_turn.id])


def kimi_tool_output(tok, prompt_ids) -> list[int]:
    """What Kimi emits (the prompt already opened reasoning): reasoning, close, text, a tool section, end."""
    tc = KIMI_K25.tool_calls
    return (enc(tok, f"the weather of day {_day(tok, prompt_ids)} so i call it") + [KIMI_K25.reasoning_close.id]
            + enc(tok, "Let me check that.") + [tc.section_begin.id, tc.call_begin.id]
            + enc(tok, "functions.get_weather:0") + [tc.argument_begin.id] + enc(tok, '{"city": "Paris"}')
            + [tc.call_end.id, tc.section_end.id, KIMI_K25.end_of_turn.id])


def _params(tmp_path: Path, profile: str, model_path: str, **over):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b"".join(orjson.dumps({"sample_id": i, "messages": [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": f"What is the weather in Paris, day {i}?"}], "tools": TOOLS}) + b"\n"
        for i in range(3)))
    o = {"output_root": str(tmp_path / "out"), "run_name": "run", "profile": profile, "model.path": model_path,
         "model.name": Path(model_path).name, "datasets": [{"name": "d0", "path": str(prompts)}],
         "generate.sampling.max_new_tokens": 96, **over}
    return load_params(REPO / "params" / "ci.yaml", o)


def _check_run(params, tok, profile) -> None:
    recs = scan_journal(params.run_dir / "records" / "d0.jsonl").records
    assert len(recs) == 3
    for r in recs:
        assert r["ids_exact"] and r["finish_reason"] == "stop"
        (call,) = r["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert r["content"].strip() == "Let me check that."  # the tool section is not in content
        assert f"day {r['sample_id']}" in r["reasoning"]
        split = profile.split_output(r["output_ids"])
        assert split.calls is not None and len(split.calls) == 1
    res = run_audit(params, progress=False, tokenizer=tok)
    assert res.failed_lists() == [[], [], []], res.summary()["failures"]
    assert res.summary()["checks"]["text.fields_match"]["applicable"] == 3
    sel = select_samples(params)
    assert sorted(str(s.key) for s in sel.samples) == ["d0/0", "d0/1", "d0/2"]
    conv = next(s for s in sel.samples if s.sample_id == "0").record
    assert conv["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("vocab", ["qwen3", "kimi"])
def test_local_tool_call_records_pass_the_audit_and_reach_the_export(vocab, qwen, kimi, tmp_path):
    tok, profile, out = (qwen, QWEN3, qwen_tool_output) if vocab == "qwen3" else (kimi, KIMI_K25, kimi_tool_output)
    params = _params(tmp_path, profile.name, "/models/target")
    model = ScriptedLM(lambda p: out(tok, p), profile.end_of_turn.id)
    run_generate(params, progress=False, model=model, tokenizer=tok)
    _check_run(params, tok, profile)


@pytest.mark.parametrize("vocab", ["qwen3", "kimi"])
def test_sglang_tool_call_records_pass_the_audit_and_reach_the_export(vocab, qwen, kimi, tmp_path):
    tok, profile, out = (qwen, QWEN3, qwen_tool_output) if vocab == "qwen3" else (kimi, KIMI_K25, kimi_tool_output)
    with LoopbackServer("sglang", model_path="/models/target", eot_id=profile.end_of_turn.id) as srv:
        srv.script = lambda prompt_ids: out(tok, prompt_ids)
        params = _params(tmp_path, profile.name, "/models/target", **{
            "generate.backend": "sglang", "generate.sglang": {"base_url": srv.base_url},
            "generate.timeout_s": 10})
        run_generate(params, progress=False, tokenizer=tok)
    _check_run(params, tok, profile)
