"""Whole conversations regenerated turn by turn (`generate.turns: all`), on-policy, with tool loops.

Every backend: the local one (a scripted model on the real Qwen3 vocabulary), SGLang and an
OpenRouter-like API (loopback servers that record what they were sent). Each turn's request
holds the model's own earlier replies, dataset tool results are spliced in when the model's
call matches, a mismatched call ends the conversation with its reason, SIGKILL then resume
gives every turn once, budgets cut at turn granularity, and 03's `prompt.on_policy` fails a
record whose history was the dataset's. Golden renderings of the history for Qwen3 (its real
template) and the Kimi profile (tests/synthetic.py's Kimi template, which follows the history rule of
the real Kimi-K2-Thinking/K2.5 template; golden written from that template's text).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from eagle3data.audit.run import run_audit
from eagle3data.generate.run import run_generate
from eagle3data.generate.ledger import read_ledger
from eagle3data.hidden.mix import build_mix
from eagle3data.core.params import load_params
from eagle3data.core.profiles import KIMI_K25, QWEN3
from eagle3data.prompts.load import Prompt, template_prompt
from eagle3data.core.reader import SampleKey, read_run
from eagle3data.core.records import scan_journal
from eagle3data.generate.turns import assistant_message, conversation_turns
from loopback import LoopbackServer
from runfiles import key as skey
from scripted_lm import ScriptedLM

REPO = Path(__file__).resolve().parents[1]
KEY_ENV = "EAGLE3DATA_TEST_TURNS_KEY"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


def _call(name: str, cid: str, args: str = '{"city": "Paris"}') -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


# w: a tool loop whose call the model repeats (spliced), then a second user turn: 3 turns
# m: the dataset calls get_time, the model get_weather: ends after turn 0 (tool_call_mismatch)
# c: a plain chat of three user turns: 3 turns
CONVERSATIONS = {
    "w": [{"role": "system", "content": "You can look up the weather."},
          {"role": "user", "content": "What is the weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", "ds_1")]},
          {"role": "tool", "tool_call_id": "ds_1", "content": "sunny, 21 C"},
          {"role": "assistant", "content": "DATASET: it is sunny."},
          {"role": "user", "content": "Thanks. Should I take a coat?"},
          {"role": "assistant", "content": "DATASET: no coat."}],
    "m": [{"role": "user", "content": "What time is it in Paris? Use the weather service."},
          {"role": "assistant", "content": "", "tool_calls": [_call("get_time", "ds_2", '{"tz": "CET"}')]},
          {"role": "tool", "tool_call_id": "ds_2", "content": "12:00"},
          {"role": "assistant", "content": "DATASET: noon."}],
    "c": [{"role": "user", "content": "Name a colour."},
          {"role": "assistant", "content": "DATASET: blue."},
          {"role": "user", "content": "Another one."},
          {"role": "assistant", "content": "DATASET: red."},
          {"role": "user", "content": "And a third."},
          {"role": "assistant", "content": "DATASET: green."}],
}
TURNS = {"w": 3, "m": 1, "c": 3}
ENDS = {"w": "done", "m": "tool_call_mismatch", "c": "done"}


def _prompts_file(tmp_path: Path, convs: dict = CONVERSATIONS, name: str = "conv") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.jsonl"
    rows = []
    for sid, conv in convs.items():
        first = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
        row = {"sample_id": sid, "messages": conv[:first], "conversation": conv}
        if any(m.get("tool_calls") for m in conv):
            row["tools"] = TOOLS
        rows.append(orjson.dumps(row))
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


def _params(tmp_path: Path, profile: str = "qwen3", model_path: str = "/models/target", **over):
    o = {"output_root": str(tmp_path / "out"), "run_name": "run", "profile": profile, "model.path": model_path,
         "model.name": Path(model_path).name,
         "datasets": over.pop("datasets", None) or [{"name": "d0", "path": str(_prompts_file(tmp_path))}],
         "generate.sampling.max_new_tokens": 200, "generate.turns": "all", **over}
    return load_params(REPO / "params" / "ci.yaml", o)


def enc(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def qwen_reply(tok, prompt_ids: list[int]) -> list[int]:
    """A scripted Qwen3: calls get_weather when the last user turn asks for weather or time (and no tool
    result came back yet), else answers; every reply names the prompt length (each output is its own)."""
    p = QWEN3
    last = tok.decode(list(prompt_ids)).rsplit("<|im_start|>", 2)[-2]
    n = len(prompt_ids)
    think = [p.reasoning_open.id] + enc(tok, f"\nthinking about a prompt of {n} tokens\n") + [p.reasoning_close.id]
    if "<tool_response>" not in last and ("weather" in last or "time" in last):
        return (think + enc(tok, "\n\nLet me check.\n") + [p.tool_calls.call_begin.id]
                + enc(tok, '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n') + [p.tool_calls.call_end.id]
                + [p.end_of_turn.id])
    return think + enc(tok, f"\n\nMODEL answer {n}.") + [p.end_of_turn.id]


def _records(params) -> list[dict]:
    return scan_journal(params.run_dir / "records" / "d0.jsonl").records


def _by_turn(recs: list[dict]) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for r in recs:
        out.setdefault(str(r["sample_id"]), {})[r["turn"]] = r
    return out


def _check_on_policy_run(params, tok, *, exact: bool = True) -> dict[str, dict[int, dict]]:
    """Every conversation's turns, each once, each generated from the model's own earlier replies."""
    recs = _records(params)
    keys = [SampleKey.of(r) for r in recs]
    assert len(keys) == len(set(keys)) == sum(TURNS.values())
    conv = _by_turn(recs)
    assert {s: sorted(t) for s, t in conv.items()} == {s: list(range(n)) for s, n in TURNS.items()}
    for sid, turns in conv.items():
        last = turns[max(turns)]
        assert last["conversation_end"].split(":")[0] == ENDS[sid]
        for t, r in turns.items():
            assert ("conversation_end" in r) == (t == max(turns))
            hist = [m for m in r["messages"] if m["role"] == "assistant"]
            assert hist == [assistant_message(turns[k]) for k in range(t)]  # the model's own replies
            assert not any("DATASET" in (m.get("content") or "") for m in r["messages"])
            if exact:
                assert r["prompt_ids"] == template_prompt(tok, Prompt("d0", sid, r["messages"], r.get("tools")), QWEN3)
    # the tool loop: the dataset's result spliced in after the model's own call, under the model's call id
    w1 = conv["w"][1]["messages"]
    assert w1[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert w1[-1] == {"role": "tool", "tool_call_id": w1[-2]["tool_calls"][0]["id"], "content": "sunny, 21 C"}
    assert conv["w"][2]["messages"][-1] == CONVERSATIONS["w"][5]  # the next user turn follows the model's answer
    assert "get_time" in conv["m"][0]["conversation_end"]
    led = read_ledger(params.run_dir)["datasets"]["d0"]
    assert led["planned"] == led["done"] == sum(TURNS.values())
    assert led["conversations"] == 3 and led["conversation_ends"] == {"done": 2, "tool_call_mismatch": 1}
    return conv


# The qwen3 profile's template (eagle3data's Qwen3-style one, `qwen.load_qwen3_tokenizer`) renders the history:
# earlier assistant turns without their reasoning (tool-loop turns too), the model's call as <tool_call>, the
# dataset's result as a user turn with <tool_response>. The answer keeps the "\n\n" after </think> (the one
# split's content span), which the template renders as it is.
GOLDEN_QWEN_W1_TAIL = (
    "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n")
GOLDEN_QWEN_C2 = (
    "<|im_start|>user\nName a colour.<|im_end|>\n"
    "<|im_start|>assistant\n\n\nMODEL answer {n0}.<|im_end|>\n"
    "<|im_start|>user\nAnother one.<|im_end|>\n"
    "<|im_start|>assistant\n\n\nMODEL answer {n1}.<|im_end|>\n"
    "<|im_start|>user\nAnd a third.<|im_end|>\n"
    "<|im_start|>assistant\n")


def _check_qwen_golden(conv, tok) -> None:
    c = conv["c"]
    assert tok.decode(c[2]["prompt_ids"]) == GOLDEN_QWEN_C2.format(n0=len(c[0]["prompt_ids"]),
                                                                    n1=len(c[1]["prompt_ids"]))
    w = conv["w"]
    text = tok.decode(w[1]["prompt_ids"])
    assert text.endswith(GOLDEN_QWEN_W1_TAIL) and "thinking about" not in text, text


def test_local_turn_by_turn_on_policy_with_tool_loop(qwen, tmp_path):
    params = _params(tmp_path, **{"generate.batch_size": 2})
    model = ScriptedLM(lambda p: qwen_reply(qwen, p), QWEN3.end_of_turn.id)
    s = run_generate(params, progress=False, model=model, tokenizer=qwen)
    assert s.status == "finished" and s.new_records == 7
    conv = _check_on_policy_run(params, qwen)
    _check_qwen_golden(conv, qwen)
    # the inspector's view of a conversation: its turns in order, where each history message came from
    view = conversation_turns(params.run_dir, "d0", "w")
    assert view["key"].tolist() == ["d0/w#0", "d0/w#1", "d0/w#2"]
    assert view["history"].tolist() == ["system, user", "system, user, turn 0, tool",
                                        "system, user, turn 0, tool, turn 1, user"]
    assert view["conversation_end"].tolist()[-1] == "done" and view["prompt_len"].is_monotonic_increasing
    # what the model was given is what was journaled, turn by turn
    assert sorted(map(tuple, model.prompts)) == sorted(tuple(r["prompt_ids"]) for r in _records(params))
    # resume: nothing left to do, no turn generated twice
    again = run_generate(params, progress=False, model=model, tokenizer=qwen)
    assert again.new_records == 0 and len(_records(params)) == 7
    # 03: on-policy passes on every turn, and each turn is its own sample (no duplicate keys)
    res = run_audit(params, progress=False, tokenizer=qwen)
    st = res.summary()["checks"]
    assert st["prompt.on_policy"]["applicable"] == 7 and st["prompt.on_policy"]["failed"] == 0
    assert st["dataset.unique_sample_id"]["failed"] == 0
    assert st["prompt.retemplate"]["failed"] == 0 and st["text.fields_match"]["failed"] == 0
    assert sorted(read_run(params.run_dir).by_key()) == sorted(
        f"d0/{s}#{t}" for s, n in TURNS.items() for t in range(n))
    # each turn is one training sequence (its prompt ids + its output ids, loss on the output), audited per turn
    mix = build_mix(params, write=False)
    assert sorted(str(x.key) for x in mix.samples) == sorted(f"d0/{s}#{t}" for s, n in TURNS.items() for t in range(n))
    by_key = {SampleKey.of(r): r for r in _records(params)}
    for x in mix.samples:
        r = by_key[x.key]
        assert x.input_ids == r["prompt_ids"] + r["output_ids"]
        assert x.loss_mask == [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"])


def test_on_policy_check_fails_a_history_from_the_dataset(qwen, tmp_path):
    params = _params(tmp_path)
    model = ScriptedLM(lambda p: qwen_reply(qwen, p), QWEN3.end_of_turn.id)
    run_generate(params, progress=False, model=model, tokenizer=qwen)
    path = params.run_dir / "records" / "d0.jsonl"
    recs = _records(params)
    for r in recs:  # turn 2 of `c` as a turns: last run would have it: the dataset's replies in its history
        if r["sample_id"] == "c" and r["turn"] == 2:
            r["messages"] = CONVERSATIONS["c"][:5]
            r["prompt_ids"] = template_prompt(qwen, Prompt("d0", "c", r["messages"]), QWEN3)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    res = run_audit(params, progress=False, tokenizer=qwen)
    failing = res.failing("prompt.on_policy", k=10)
    assert [(str(s), ) for s in failing["sample_id"]] == [("c",)]
    assert res.summary()["checks"]["prompt.on_policy"]["failed"] == 1
    assert res.summary()["checks"]["prompt.retemplate"]["failed"] == 0  # its ids are honest: only its history is not
    assert conversation_turns(params.run_dir, "d0", "c")["history"].tolist()[2] == \
        "user, assistant (NOT a journaled turn), user, assistant (NOT a journaled turn), user"
    mix = build_mix(params, write=False)  # the verdict is per turn: only that turn leaves the mix
    assert skey("d0", "c", 2) not in {x.key for x in mix.samples} and len(mix.samples) == 6


def test_max_turns_and_budget_cut_at_turn_granularity(qwen, tmp_path):
    params = _params(tmp_path / "a", **{"generate.max_turns": 2, "generate.batch_size": 1})
    model = ScriptedLM(lambda p: qwen_reply(qwen, p), QWEN3.end_of_turn.id)
    run_generate(params, progress=False, model=model, tokenizer=qwen)
    conv = _by_turn(_records(params))
    assert {s: sorted(t) for s, t in conv.items()} == {"w": [0, 1], "m": [0], "c": [0, 1]}
    assert conv["c"][1]["conversation_end"].startswith("max_turns")
    # a budget: every turn counts; the turn that reaches it is the last one sent, the rest are skipped
    budget = 150
    params = _params(tmp_path / "b", **{"generate.batch_size": 1, "datasets": [
        {"name": "d0", "path": str(_prompts_file(tmp_path)), "token_budget": budget}]})
    s = run_generate(params, progress=False, model=model, tokenizer=qwen)
    recs = _records(params)
    led = read_ledger(params.run_dir)["datasets"]["d0"]
    used = [r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in recs]
    assert 0 < len(recs) < sum(TURNS.values()) and sum(used[:-1]) < budget <= sum(used)
    assert led["budget_reached"] and led["done"] == len(recs)
    assert led["done"] + led["errors"] + led["skipped"] + led["cancelled"] == led["planned"]
    assert sum(led["conversation_ends"].values()) == led["conversations"] == 3  # every one ended, by reason
    assert led["conversation_ends"].get("budget", 0) == led["skipped"] >= 1
    assert s.table().loc["d0", "missing"] == 0


def test_local_stop_between_turns_then_resume(qwen, tmp_path):
    """A STOP file once both slots hold a first turn: both rows in flight are journaled, the turns they
    would have led to are not sent (counted skipped, their conversations go on at resume), and resume
    finishes every conversation on-policy with every turn once."""
    params = _params(tmp_path, **{"generate.batch_size": 2})
    stop = params.run_dir / "STOP"
    model = ScriptedLM(lambda p: qwen_reply(qwen, p), QWEN3.end_of_turn.id)
    calls = []

    def script(p):
        if len(calls) == 1:
            stop.touch()  # while the second prompt is prefilled: two rows in flight
        calls.append(1)
        return qwen_reply(qwen, p)

    model.script = script
    s = run_generate(params, progress=False, model=model, tokenizer=qwen)
    assert s.status == "stopped" and "STOP file" in s.stop_reason and s.new_records == 2 and len(model.prompts) == 2
    led = read_ledger(params.run_dir)["datasets"]["d0"]
    assert led["done"] == 2 and led["done"] + led["skipped"] == led["planned"]
    assert all(r["turn"] == 0 for r in _records(params))
    stop.unlink()
    again = ScriptedLM(lambda p: qwen_reply(qwen, p), QWEN3.end_of_turn.id)
    s2 = run_generate(params, progress=False, model=again, tokenizer=qwen)
    assert s2.status == "finished" and s2.new_records == sum(TURNS.values()) - 2
    _check_on_policy_run(params, qwen)


def test_sglang_turn_by_turn_requests_hold_the_models_own_replies(qwen, tmp_path):
    with LoopbackServer("sglang", model_path="/models/target", eot_id=QWEN3.end_of_turn.id) as srv:
        srv.script = lambda prompt_ids: qwen_reply(qwen, prompt_ids)
        params = _params(tmp_path, **{"generate.backend": "sglang", "generate.sglang": {"base_url": srv.base_url},
                                      "generate.timeout_s": 10, "generate.concurrency": 3})
        s = run_generate(params, progress=False, tokenizer=qwen)
        sent = [r["body"]["input_ids"] for r in srv.requests if r["path"] == "/generate"]
    assert s.status == "finished"
    conv = _check_on_policy_run(params, qwen)
    _check_qwen_golden(conv, qwen)
    assert sorted(map(tuple, sent)) == sorted(tuple(r["prompt_ids"]) for r in _records(params))
    # each turn's request holds the model's earlier output ids verbatim (the history from its own reply)
    for turns in conv.values():
        for t in range(1, len(turns)):
            text = qwen.decode(turns[t]["prompt_ids"])
            assert turns[t - 1]["content"] in text and "DATASET" not in text


def _sent_reasoning(field: str | None, text: str) -> dict:
    """What the assistant message of the history carries for its reasoning, per generate.openai.history_reasoning
    (None: from the host; the loopback is not openrouter.ai, so `reasoning_content`)."""
    if field == "none":
        return {}
    if field == "reasoning_details":
        return {"reasoning_details": [{"type": "reasoning.text", "text": text, "format": "unknown", "index": 0}]}
    return {field or "reasoning_content": text}


@pytest.mark.parametrize("field", [None, "reasoning", "reasoning_details", "none"])
def test_openai_turns_send_earlier_replies_back_as_the_api_takes_them(qwen, tmp_path, monkeypatch, field):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    convs = {"w": CONVERSATIONS["w"], "c": CONVERSATIONS["c"][:4]}
    with LoopbackServer("openai") as srv:
        api = {"base_url": srv.base_url, "model": "m", "api_key_env": KEY_ENV}
        if field is not None:
            api["history_reasoning"] = field
        params = _params(tmp_path, **{
            "generate.backend": "openai", "generate.timeout_s": 10, "generate.concurrency": 2, "generate.openai": api,
            "datasets": [{"name": "d0", "path": str(_prompts_file(tmp_path, convs, "own"))}]})
        s = run_generate(params, progress=False, tokenizer=qwen)
        sent = [r["body"] for r in srv.requests if r["path"] == "/chat/completions"]
    assert s.status == "finished"
    conv = _by_turn(_records(params))
    # the loopback calls the first tool whenever tools are declared: w's turn 0 matches the dataset's call,
    # turn 1 calls again where the dataset answered: the conversation ends there, with its reason
    assert sorted(conv["w"]) == [0, 1] and conv["w"][1]["conversation_end"].startswith("tool_call_unmatched")
    assert sorted(conv["c"]) == [0, 1] and conv["c"][1]["conversation_end"] == "done"
    assert len(sent) == 4
    by_msgs = {json.dumps(b["messages"], sort_keys=True): b for b in sent}
    for turns in conv.values():
        for t, r in turns.items():
            hist = [m for m in r["messages"] if m["role"] == "assistant"]
            assert hist == [assistant_message(turns[k]) for k in range(t)]
            assert r["prompt_ids"] == template_prompt(qwen, Prompt("d0", "x", r["messages"], r.get("tools")), QWEN3)
    w1 = conv["w"][1]
    body = next(b for b in sent if len(b["messages"]) == len(w1["messages"]) and b.get("tools"))
    reply = body["messages"][-2]  # the model's own turn 0, as the API takes it back
    r0 = conv["w"][0]
    assert r0["reasoning"]
    assert reply == {"role": "assistant", "content": r0["content"], **_sent_reasoning(field, r0["reasoning"]),
                     "tool_calls": r0["tool_calls"]}
    c1_sent = next(b for b in sent if not b.get("tools") and len(b["messages"]) == 3)["messages"][1]
    assert c1_sent == {"role": "assistant", "content": conv["c"][0]["content"],
                       **_sent_reasoning(field, conv["c"][0]["reasoning"])}
    # the journaled history keeps the template's key whatever the API was sent (prompt_ids rendered from it)
    assert conv["w"][1]["messages"][-2]["reasoning_content"] == r0["reasoning"]
    assert body["messages"][-1] == {"role": "tool", "tool_call_id": r0["tool_calls"][0]["id"],
                                    "content": "sunny, 21 C"}
    c1 = next(b for b in sent if not b.get("tools") and len(b["messages"]) == 3)
    assert c1["messages"][1]["content"] == conv["c"][0]["content"] != CONVERSATIONS["c"][1]["content"]
    assert json.dumps(c1["messages"], sort_keys=True) in by_msgs
    if field is None:
        from eagle3data.generate.backends.openai_api import history_reasoning_field

        api = params.generate.openai
        by_host = {u: history_reasoning_field(api.model_copy(update={"base_url": u})) for u in (
            "https://openrouter.ai/api/v1", "https://api.moonshot.ai/v1", "https://api.moonshot.cn/v1",
            "http://127.0.0.1:30000/v1")}
        assert by_host == {"https://openrouter.ai/api/v1": "reasoning_details",
                           "https://api.moonshot.ai/v1": "reasoning_content",
                           "https://api.moonshot.cn/v1": "reasoning_content",
                           "http://127.0.0.1:30000/v1": "reasoning_content"}
    led = read_ledger(params.run_dir)["datasets"]["d0"]
    assert led["done"] == 4 == led["planned"] and led["conversation_ends"] == {"done": 1, "tool_call_unmatched": 1}


def test_sigkill_mid_conversation_then_resume_gives_every_turn_once(tmp_path):
    """A headless run (SmolLM2's tokenizer, the SGLang loopback) killed with SIGKILL while conversations
    are half done, a torn line on the journal; resume finishes every conversation, each turn once, and
    every turn's history is the model's own replies before it."""
    convs = {f"s{i}": [m for k in range(3) for m in ({"role": "user", "content": f"question {k} of chat {i}"},
                                                       {"role": "assistant", "content": f"DATASET reply {k}"})]
             for i in range(6)}
    prompts = _prompts_file(tmp_path, convs)
    out = tmp_path / "out"
    over = ["-p", "output_root", str(out), "-p", "run_name", "kill", "-p", "datasets",
            json.dumps([{"name": "d0", "path": str(prompts)}]), "-p", "generate.turns", "all",
            "-p", "generate.concurrency", "2", "-p", "generate.timeout_s", "20"]
    journal = out / "kill" / "records" / "d0.jsonl"
    with LoopbackServer("sglang", latency=0.15) as srv:
        over += ["-p", "generate.backend", "sglang", "-p", "generate.sglang", json.dumps({"base_url": srv.base_url})]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        proc = subprocess.Popen([sys.executable, "-m", "eagle3data", "generate", str(REPO / "params" / "ci.yaml"),
                                 "--quiet", *over], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            for _ in range(600):  # up to 60 s for 5 journaled turns (model load included)
                if journal.exists() and journal.read_bytes().count(b"\n") >= 5:
                    break
                if proc.poll() is not None:
                    pytest.fail(f"generate exited early: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.1)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(timeout=30)
        before = scan_journal(journal).records
        assert 5 <= len(before) < 18
        with open(journal, "ab") as f:  # a write cut by the crash
            f.write(b'{"dataset": "d0", "sample_id": "s0", "turn": 2, "messa')
        params = load_params(REPO / "params" / "ci.yaml", {
            "output_root": str(out), "run_name": "kill", "datasets": [{"name": "d0", "path": str(prompts)}],
            "generate.turns": "all", "generate.backend": "sglang", "generate.sglang": {"base_url": srv.base_url},
            "generate.timeout_s": 20})
        s = run_generate(params, progress=False)
    assert s.status == "finished" and s.torn_tail_bytes == {"d0": len(b'{"dataset": "d0", "sample_id": "s0", '
                                                                      b'"turn": 2, "messa')}
    recs = scan_journal(journal).records
    assert recs[: len(before)] == before  # nothing journaled is ever rewritten
    keys = [SampleKey.of(r) for r in recs]
    assert len(keys) == len(set(keys)) == 18  # every turn exactly once
    conv = _by_turn(recs)
    for sid, turns in conv.items():
        assert sorted(turns) == [0, 1, 2] and turns[2]["conversation_end"] == "done"
        for t, r in turns.items():
            hist = [m for m in r["messages"] if m["role"] == "assistant"]
            assert hist == [assistant_message(turns[k]) for k in range(t)]
            assert [m["content"] for m in r["messages"] if m["role"] == "user"] == \
                [f"question {k} of chat {sid[1:]}" for k in range(t + 1)]
    led = read_ledger(params.run_dir)["datasets"]["d0"]
    assert led["done"] == led["planned"] == 18 and led["resumed"] == len(before)
    assert led["conversation_ends"] == {"done": 6}


def test_resume_never_builds_a_history_from_an_error_record(qwen, tmp_path):
    """A turn journaled as an error: without retry_errors its conversation ends there; with it, the turn is
    generated again (its new line supersedes the error) and the conversation goes on from the model's reply."""
    params = _params(tmp_path, **{"generate.max_turns": 1})
    model = ScriptedLM(lambda p: qwen_reply(qwen, p), QWEN3.end_of_turn.id)
    run_generate(params, progress=False, model=model, tokenizer=qwen)
    path = params.run_dir / "records" / "d0.jsonl"
    recs = _records(params)
    c0 = next(r for r in recs if r["sample_id"] == "c")
    err = dict(c0, turn=1, finish_reason="error", error="HTTP 500", output_ids=None, content=None, reasoning=None,
               messages=[{"role": "user", "content": "anything"}])
    del err["conversation_end"]
    path.write_bytes(path.read_bytes() + orjson.dumps(err) + b"\n")
    # c's turn 0 ended by max_turns; lift it: the plan replays c's turns 0 and 1 (the error)
    more = load_params(REPO / "params" / "ci.yaml", {**_overrides(params), "generate.max_turns": 3})
    s = run_generate(more, progress=False, model=model, tokenizer=qwen)
    conv = _by_turn(_records(more))
    assert sorted(conv["c"]) == [0, 1] and s.new_records == 2  # w's turns 1 and 2 only: c ended at its error
    assert read_ledger(more.run_dir)["datasets"]["d0"]["conversation_ends"] == {
        "done": 1, "tool_call_mismatch": 1, "error": 1}
    retry = load_params(REPO / "params" / "ci.yaml", {**_overrides(params), "generate.max_turns": 3,
                                                      "generate.retry_errors": True})
    run_generate(retry, progress=False, model=model, tokenizer=qwen)
    view = read_run(retry.run_dir)
    c1 = view.by_key()[skey("d0", "c", 1)]
    assert c1["finish_reason"] == "stop" and [m for m in c1["messages"] if m["role"] == "assistant"] == \
        [assistant_message(c0)]
    assert len(view.datasets["d0"].superseded()) == 1
    c2 = view.by_key()[skey("d0", "c", 2)]
    assert [m for m in c2["messages"] if m["role"] == "assistant"] == [assistant_message(c0), assistant_message(c1)]


def _overrides(params) -> dict:
    return {"output_root": str(params.output_root), "run_name": params.run_name, "profile": "qwen3",
            "model.path": "/models/target", "model.name": "target", "generate.turns": "all",
            "generate.sampling.max_new_tokens": 200,
            "datasets": [d.model_dump(exclude_none=True) for d in params.datasets]}


# ---------------------------------------------------------------- Kimi: the history rule of reference §2


@pytest.fixture()
def kimi():
    from synthetic import SyntheticTokenizer

    return SyntheticTokenizer(KIMI_K25)


def _tc(cid: str, args: str = '{"city": "Paris"}') -> dict:
    return {"id": cid, "type": "function", "function": {"name": cid.split(".")[1].split(":")[0], "arguments": args}}


# Kimi-K2-Thinking's chat template (llama.cpp models/templates/moonshotai-Kimi-K2-Thinking.jinja; K2.5's splits the
# same way): history is every message up to the last assistant message WITHOUT tool calls; there an assistant turn
# renders `<think></think>` + content; after it (the tool loop in progress) `<think>{reasoning_content}</think>`.
# Two tool loops: the first one's reasoning (r0, r1) is dropped once the answer a1 closed it; the second one's (r2)
# is kept while it runs. Hand-written from the template's rule.
KIMI_TWO_LOOPS = [
    {"role": "system", "content": "You can look up the weather."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "let me see", "reasoning_content": "r0",
     "tool_calls": [_tc("functions.get_weather:0")]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "content": "", "reasoning_content": "r2",
     "tool_calls": [_tc("functions.get_weather:1", '{"city": "Rome"}')]},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "name": "get_weather", "content": "rain"},
]
GOLDEN_KIMI_TWO_LOOPS = (
    "<|im_system|>system<|im_middle|>You can look up the weather.<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>let me see<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>a1<|im_end|>"
    "<|im_user|>user<|im_middle|>And Rome?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>r2</think><|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:1\nrain<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>")


def test_kimi_template_history_rule_golden(kimi):
    """The synthetic Kimi template renders history as the real template does (golden above). Where the rule
    differs from "drop reasoning before the last user message": a user turn after a tool result with no answer
    in between keeps the loop's reasoning (no assistant message without tool calls yet), and an answer is
    history itself (its reasoning dropped) even when no user turn follows it."""
    assert kimi.render(KIMI_TWO_LOOPS, add_generation_prompt=True) == GOLDEN_KIMI_TWO_LOOPS
    interjected = KIMI_TWO_LOOPS[:4] + [{"role": "user", "content": "Go on."}]
    text = kimi.render(interjected, add_generation_prompt=True)
    assert "<think>r0</think>let me see" in text and text.endswith(
        "<|im_user|>user<|im_middle|>Go on.<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    answered = kimi.render(KIMI_TWO_LOOPS[:5])
    assert "<think>r0</think>" not in answered and answered.endswith("<think></think>a1<|im_end|>")
    off = kimi.render(KIMI_TWO_LOOPS[:2], add_generation_prompt=True, thinking=False)
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")


def kimi_reply(tok, prompt_ids):
    """A scripted Kimi (the prompt opened reasoning): a tool call for a weather question, else an answer."""
    p = KIMI_K25
    tc = p.tool_calls
    text = tok.decode(list(prompt_ids))
    last = text.rsplit("<|im_end|>", 1)[0].rsplit("<|im_middle|>", 1)[-1]
    think = enc(tok, f"reasoning at {len(prompt_ids)}") + [p.reasoning_close.id]
    if "weather" in last and "## Return of" not in text.rsplit("<|im_user|>", 1)[-1]:
        return (think + enc(tok, "let me see") + [tc.section_begin.id, tc.call_begin.id]
                + enc(tok, "functions.get_weather:0") + [tc.argument_begin.id] + enc(tok, '{"city": "Paris"}')
                + [tc.call_end.id, tc.section_end.id, p.end_of_turn.id])
    return think + enc(tok, f"answer at {len(prompt_ids)}") + [p.end_of_turn.id]


def test_kimi_history_golden(kimi, tmp_path):
    """Kimi profile, end to end: turn 1 (inside the tool loop) keeps turn 0's reasoning; turn 2 (turn 1's
    answer closed the loop) renders both earlier turns as `<think></think>` + answer, the call section and the
    tool return."""
    params = _params(tmp_path, profile="kimi-k2.5", **{"datasets": [
        {"name": "d0", "path": str(_prompts_file(tmp_path, {"w": CONVERSATIONS["w"]}, "own"))}]})
    model = ScriptedLM(lambda p: kimi_reply(kimi, p), KIMI_K25.end_of_turn.id)
    run_generate(params, progress=False, model=model, tokenizer=kimi)
    w = _by_turn(_records(params))["w"]
    assert sorted(w) == [0, 1, 2] and w[2]["conversation_end"] == "done"
    n0, n1, n2 = (len(w[t]["prompt_ids"]) for t in range(3))
    decl = "<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS, separators=(",", ":")) + "<|im_end|>"
    head = (decl + "<|im_system|>system<|im_middle|>You can look up the weather.<|im_end|>"
            "<|im_user|>user<|im_middle|>What is the weather in Paris?<|im_end|>")
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    ret = "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny, 21 C<|im_end|>"
    gen = "<|im_assistant|>assistant<|im_middle|><think>"
    assert kimi.decode(w[1]["prompt_ids"]) == (
        head + f"<|im_assistant|>assistant<|im_middle|><think>reasoning at {n0}</think>let me see{call}<|im_end|>"
        + ret + gen)
    assert kimi.decode(w[2]["prompt_ids"]) == (
        head + f"<|im_assistant|>assistant<|im_middle|><think></think>let me see{call}<|im_end|>" + ret
        + f"<|im_assistant|>assistant<|im_middle|><think></think>answer at {n1}<|im_end|>"
        + "<|im_user|>user<|im_middle|>Thanks. Should I take a coat?<|im_end|>" + gen)
    assert w[2]["content"] == f"answer at {n2}"


def test_vllm_turn_by_turn_prompts_hold_the_models_own_replies(tmp_path, smollm2_tokenizer):
    """vLLM (`/v1/completions` with token-id prompts): each turn's prompt ids, as sent, render the model's own
    earlier replies (SmolLM2's template), never the dataset's."""
    from eagle3data.core.profiles import SMOLLM2

    convs = {f"v{i}": [m for k in range(2) for m in ({"role": "user", "content": f"question {k} of chat {i}"},
                                                       {"role": "assistant", "content": f"DATASET reply {k}"})]
             for i in range(3)}
    with LoopbackServer("vllm") as srv:
        params = load_params(REPO / "params" / "ci.yaml", {
            "output_root": str(tmp_path / "out"), "run_name": "run", "generate.turns": "all",
            "datasets": [{"name": "d0", "path": str(_prompts_file(tmp_path, convs))}],
            "generate.backend": "vllm", "generate.vllm": {"base_url": srv.base_url}, "generate.timeout_s": 10})
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        sent = [r["body"]["prompt"] for r in srv.requests if r["path"] == "/completions"]
    assert s.status == "finished"
    conv = _by_turn(_records(params))
    assert {k: sorted(v) for k, v in conv.items()} == {k: [0, 1] for k in convs}
    assert sorted(map(tuple, sent)) == sorted(tuple(r["prompt_ids"]) for r in _records(params))
    for sid, turns in conv.items():
        assert turns[1]["conversation_end"] == "done" and turns[0]["ids_exact"]
        assert [m for m in turns[1]["messages"] if m["role"] == "assistant"] == [assistant_message(turns[0])]
        text = smollm2_tokenizer.decode(turns[1]["prompt_ids"])
        assert turns[0]["content"] in text and "DATASET" not in text
        assert turns[1]["prompt_ids"] == template_prompt(smollm2_tokenizer, Prompt("d0", sid, turns[1]["messages"]),
                                                         SMOLLM2)


def test_turns_per_dataset_in_one_run(qwen, tmp_path):
    """`datasets[].turns` overrides `generate.turns`: one dataset turn by turn, the other its last turn only
    (records without `turn`, keyed `dataset/sample_id` as before); a journal never mixes the two."""
    last = tmp_path / "last.jsonl"
    last.write_bytes(orjson.dumps({"sample_id": "c", "messages": CONVERSATIONS["c"][:3]}) + b"\n")
    params = _params(tmp_path, **{"generate.turns": "last", "datasets": [
        {"name": "d0", "path": str(_prompts_file(tmp_path)), "turns": "all"}, {"name": "d1", "path": str(last)}]})
    model = ScriptedLM(lambda p: qwen_reply(qwen, p), QWEN3.end_of_turn.id)
    s = run_generate(params, progress=False, model=model, tokenizer=qwen)
    assert s.new_records == sum(TURNS.values()) + 1
    _check_on_policy_run(params, qwen)
    (single,) = scan_journal(params.run_dir / "records" / "d1.jsonl").records
    assert "turn" not in single and SampleKey.of(single) == "d1/c"
    assert [m["content"] for m in single["messages"]] == [m["content"] for m in CONVERSATIONS["c"][:3]]
    led = read_ledger(params.run_dir)["datasets"]["d1"]
    assert led["planned"] == led["done"] == 1 and led["conversations"] == 0
    flipped = load_params(REPO / "params" / "ci.yaml", {**_overrides(params), "datasets": [
        {"name": "d0", "path": str(tmp_path / "conv.jsonl")}], "generate.turns": "last"})
    with pytest.raises(ValueError, match="turns all, and this run asks for last"):
        run_generate(flipped, progress=False, model=model, tokenizer=qwen)
