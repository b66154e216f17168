"""The inspector shows a conversation regenerated turn by turn: its turns in order, each turn's prompt and
output ids, and where each message of the inspected turn's history came from.

The run is real: 01 (local backend, a scripted model on the real Qwen3 vocabulary) regenerates a tool loop
and a plain chat turn by turn, 03 audits it, the inspector renders a turn. A journal whose history holds a
dataset reply (off-policy) shows that message as no journaled turn.
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from eagle3data.audit.run import run_audit
from eagle3data.generate.run import run_generate
from eagle3data.audit.inspector import failing_records, history_labels, inspect_record
from eagle3data.core.params import load_params
from eagle3data.core.profiles import QWEN3
from eagle3data.core.records import scan_journal
from scripted_lm import ScriptedLM

REPO = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "ds_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
CONVERSATIONS = {
    # a tool loop (the model's call matches the dataset's: its result is spliced in), then a second user turn
    "w": [{"role": "system", "content": "Tu peux consulter la météo."},
          {"role": "user", "content": "Quel temps fait-il à Zürich ? ☔"},
          {"role": "assistant", "content": "", "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "ds_1", "content": "ensoleillé, 21 °C"},
          {"role": "assistant", "content": "DATASET: il fait beau."},
          {"role": "user", "content": "Merci. Un manteau ?"},
          {"role": "assistant", "content": "DATASET: non."}],
    "c": [{"role": "user", "content": "Name a colour. 🎨"},
          {"role": "assistant", "content": "DATASET: blue."},
          {"role": "user", "content": "Another one."},
          {"role": "assistant", "content": "DATASET: red."}],
}


def _enc(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _reply(tok, prompt_ids: list[int]) -> list[int]:
    """A scripted Qwen3 reply: reasoning, then a get_weather call when the last turn asks about the weather
    (and no result came back yet), else an answer naming the prompt length."""
    last = tok.decode(list(prompt_ids)).rsplit("<|im_start|>", 2)[-2]
    think = [QWEN3.reasoning_open.id] + _enc(tok, f"\nprompt of {len(prompt_ids)} tokens\n") + [QWEN3.reasoning_close.id]
    if "<tool_response>" not in last and "temps" in last:
        return (think + _enc(tok, "\n\nJe regarde.\n") + [QWEN3.tool_calls.call_begin.id]
                + _enc(tok, '\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n')
                + [QWEN3.tool_calls.call_end.id, QWEN3.end_of_turn.id])
    return think + _enc(tok, f"\n\nMODEL answer {len(prompt_ids)}.") + [QWEN3.end_of_turn.id]


def _Scripted(tok) -> ScriptedLM:
    """Each row's reply from `_reply`, then end-of-turn."""
    return ScriptedLM(lambda prompt: _reply(tok, prompt), QWEN3.end_of_turn.id)


@pytest.fixture(scope="module")
def turn_run(qwen, tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect_turns")
    prompts = root / "conv.jsonl"
    rows = []
    for sid, conv in CONVERSATIONS.items():
        first = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
        rows.append(orjson.dumps({"sample_id": sid, "messages": conv[:first], "conversation": conv,
                                  **({"tools": TOOLS} if sid == "w" else {})}))
    prompts.write_bytes(b"\n".join(rows) + b"\n")
    params = load_params(REPO / "params" / "ci.yaml", {
        "output_root": str(root / "out"), "run_name": "run", "profile": "qwen3", "model.path": "/models/target",
        "model.name": "target", "datasets": [{"name": "d0", "path": str(prompts)}],
        "generate.sampling.max_new_tokens": 200, "generate.turns": "all", "generate.batch_size": 2})
    s = run_generate(params, progress=False, model=_Scripted(qwen), tokenizer=qwen)
    assert s.status == "finished" and s.new_records == 5  # w: 3 turns, c: 2 turns
    return params


def _records(params) -> dict[tuple[str, int], dict]:
    return {(str(r["sample_id"]), r["turn"]): r for r in scan_journal(params.run_dir / "records" / "d0.jsonl").records}


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


def _section(html: str, title: str) -> str:
    start = html.index(title)
    return html[start:html.index("</details>", start)]


def test_a_turn_shows_its_conversation_and_where_its_history_came_from(turn_run, qwen):
    res = run_audit(turn_run, progress=False, tokenizer=qwen)
    recs = _records(turn_run)
    view = inspect_record(res, "d0", "w#2", qwen)
    assert view.found and view.sample_id == "w#2"
    html = view.html
    conv = html[html.index("Conversation d0/w"):html.index("Check verdicts")]
    # every turn in order, the inspected one marked, with its ids' lengths and how the conversation ended
    assert "3 journaled turns, ended: done" in conv
    table = conv[conv.index("<tbody>"):conv.index("</tbody>")]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in table.split("</tr>")[:-1]]
    assert [c[:2] for c in cells] == [["0", "d0/w#0"], ["1", "d0/w#1"], ["2", "d0/w#2"]]
    for c in cells:
        r = recs["w", int(c[0])]
        assert c[2] == "stop" and c[3] == str(len(r["prompt_ids"])) and c[4] == str(len(r["output_ids"]))
    # turn 1's prompt repeats turn 0's prompt but for its last token ("assistant\n" then the reply rendered
    # without its reasoning: "\n\n\nJe regarde" tokenizes the newlines together); turn 2's repeats turn 1's
    def shared(a, b):
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    for t in (1, 2):
        prev = [recs["w", k]["prompt_ids"] + recs["w", k]["output_ids"] for k in range(t)]
        want = max(shared(recs["w", t]["prompt_ids"], q) for q in prev)
        assert cells[t][5] == str(want) and want >= len(recs["w", t - 1]["prompt_ids"]) - 1
    assert cells[0][5] == "0"
    assert [c[6] for c in cells] == ["system, user", "system, user, turn 0, tool",
                                     "system, user, turn 0, tool, turn 1, user"]
    assert cells[2][7] == "done" and "background:#fff8c5" in table.split("</tr>")[2]
    # each turn's prompt and output ids (the new part of the prompt, the output), decoded with token titles
    for t in range(3):
        r = recs["w", t]
        assert f"turn {t}{' (inspected)' if t == 2 else ''}: prompt {len(r['prompt_ids'])} ids, output " \
               f"{len(r['output_ids'])} ids" in conv
        last_out = len(r["prompt_ids"]) + len(r["output_ids"]) - 1
        assert f'title="pos {last_out} · id {r["output_ids"][-1]}"' in conv
    assert "<details open><summary>turn 2 (inspected)" in conv and "<details><summary>turn 0:" in conv
    # the inspected turn's history, message by message: the model's own replies, the dataset's messages
    msgs = _text(_section(html, "Prompt messages by role"))
    assert "(and where each came from)" in msgs
    for label in ("system · dataset system message", "user · dataset user message",
                  "assistant · turn 0: the model's own reply", "tool · dataset tool result, spliced in after turn 0's call",
                  "assistant · turn 1: the model's own reply", "tool calls: get_weather"):
        assert label in msgs, label
    assert "ensoleillé, 21 °C" in msgs and "DATASET" not in msgs
    assert "NOT a journaled turn" not in html


def test_a_conversation_id_opens_its_last_turn_and_plain_records_have_no_section(turn_run, qwen):
    res = run_audit(turn_run, progress=False, tokenizer=qwen)
    view = inspect_record(res, "d0", "c", qwen)
    assert view.found and view.sample_id == "c#1"
    assert "is a conversation of 2 turns: showing its last turn (c#1)" in view.html
    assert "2 journaled turns, ended: done" in view.html
    first = inspect_record(res, "d0", "c#0", qwen)
    assert first.sample_id == "c#0" and "turn 0 inspected" in first.html
    assert "is not in this run" in inspect_record(res, "d0", "c#7", qwen).html


def test_a_dataset_reply_in_the_history_is_shown_as_no_journaled_turn(turn_run, qwen, tmp_path):
    """A journal whose turn 1 history holds the dataset's reply (what `prompt.on_policy` fails): the inspector
    of that turn (opened from the failing records) marks the message red as off-policy."""
    import shutil

    rd = tmp_path / "out" / "run"
    shutil.copytree(turn_run.run_dir / "records", rd / "records")
    path = rd / "records" / "d0.jsonl"
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    for r in lines:
        if (r["sample_id"], r["turn"]) == ("c", 1):
            r["messages"][1] = CONVERSATIONS["c"][1]  # the dataset's reply instead of the model's turn 0
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    params = load_params(REPO / "params" / "ci.yaml", {**_overrides(turn_run), "output_root": str(tmp_path / "out")})
    res = run_audit(params, progress=False, tokenizer=qwen)
    assert res.summary()["checks"]["prompt.on_policy"]["failed"] == 1
    views = failing_records(res, qwen, 3)
    mine = [v for v in views if v.sample_id == "c#1"]
    assert len(mine) == 1  # by row: the conversation's other turn is not shown in its place
    html = mine[0].html
    assert "user, assistant (NOT a journaled turn), user" in html
    assert "NOT a journaled turn: an assistant message from the dataset (off-policy)" in _text(html)
    assert "color:#cf222e;font-weight:bold" in _section(html, "Prompt messages by role")


def test_history_labels_name_the_turn_a_tool_result_answers():
    assert history_labels(["system", "user", "turn 0", "tool", "tool", "turn 1", "user"]) == [
        "dataset system message", "dataset user message", "turn 0: the model's own reply",
        "dataset tool result, spliced in after turn 0's call", "dataset tool result, spliced in after turn 0's call",
        "turn 1: the model's own reply", "dataset user message"]


def _overrides(params) -> dict:
    return {"run_name": "run", "profile": "qwen3", "model.path": "/models/target", "model.name": "target",
            "datasets": [d.model_dump() for d in params.datasets], "generate.turns": "all"}
