"""A conversation cut because its NEXT prompt is too long ends with `conversation_end: too_long` in its last record.

`generate.turns: all` regenerates each conversation turn by turn. When the prompt of the next turn (the history,
the model's reply, the dataset's next user turn) reaches `model.max_context`, that turn is never sent and the
conversation ends: the next prompt is templated before the last turn's record is written, so that record says so
(`too_long: turn T: prompt of N tokens reaches model.max_context M`), on every path that runs turns (the local
backend's batch loop, the HTTP engine's `follow`). The ledger counts it as before, the inspector shows the
conversation as ended, and resume never continues it, even with a larger `model.max_context`.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from eagle3data.audit.run import run_audit
from eagle3data.generate.run import run_generate
from eagle3data.audit.inspector import inspect_record
from eagle3data.generate.ledger import read_ledger
from eagle3data.core.params import load_params
from eagle3data.core.profiles import QWEN3
from eagle3data.core.records import scan_journal
from eagle3data.generate.turns import conversation_turns, end_kind
from loopback import LoopbackServer
from scripted_lm import ScriptedLM

REPO = Path(__file__).resolve().parents[1]
KEY_ENV = "EAGLE3DATA_TEST_CONV_END_KEY"
MAX_CONTEXT = 200
# long: its second user turn alone is longer than MAX_CONTEXT (turn 0 fits): it ends after turn 0, too_long
# short: two short exchanges: done
CONVERSATIONS = {
    "long": [{"role": "user", "content": "Say hello."},
             {"role": "assistant", "content": "DATASET: hello."},
             {"role": "user", "content": "Now read this: " + "lorem ipsum dolor " * 120},
             {"role": "assistant", "content": "DATASET: read."}],
    "short": [{"role": "user", "content": "Name a colour."},
              {"role": "assistant", "content": "DATASET: blue."},
              {"role": "user", "content": "Another one."},
              {"role": "assistant", "content": "DATASET: red."}],
}
NOT_ENDED = "not ended in the journal"


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "conv.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"sample_id": sid, "messages": conv[:1], "conversation": conv}) + b"\n"
                              for sid, conv in CONVERSATIONS.items()))
    return path


def _params(tmp_path: Path, **over):
    return load_params(REPO / "params" / "ci.yaml", {
        "output_root": str(tmp_path / "out"), "run_name": "run", "profile": "qwen3", "model.path": "/models/target",
        "model.name": "target", "model.max_context": MAX_CONTEXT,
        "datasets": [{"name": "d0", "path": str(_prompts(tmp_path))}],
        "generate.sampling.max_new_tokens": 64, "generate.turns": "all", **over})


def _enc(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _reply(tok, prompt_ids: list[int]) -> list[int]:
    """A scripted Qwen3 answer: short reasoning, then an answer naming the prompt length."""
    n = len(prompt_ids)
    return ([QWEN3.reasoning_open.id] + _enc(tok, f"\nprompt of {n}\n") + [QWEN3.reasoning_close.id]
            + _enc(tok, f"\n\nMODEL answer {n}.") + [QWEN3.end_of_turn.id])


def _Scripted(tok) -> ScriptedLM:
    """Each row's reply from `_reply`, then end-of-turn."""
    return ScriptedLM(lambda prompt: _reply(tok, prompt), QWEN3.end_of_turn.id)


def _turns(params) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for r in scan_journal(params.run_dir / "records" / "d0.jsonl").records:
        out.setdefault(str(r["sample_id"]), {})[r["turn"]] = r
    return out


def _check_too_long_run(params) -> dict:
    """`long` ended after turn 0 with too_long in that record (naming the turn and its prompt length), `short` done;
    the ledger counts the unsent turn planned and skipped, its rejected line, and one end of each kind."""
    conv = _turns(params)
    assert sorted(conv["long"]) == [0] and sorted(conv["short"]) == [0, 1]
    end = conv["long"][0]["conversation_end"]
    assert end_kind(end) == "too_long", end
    assert end.startswith("too_long: turn 1: prompt of ") and end.endswith(f"reaches model.max_context {MAX_CONTEXT}")
    assert int(end.split("prompt of ")[1].split()[0]) >= MAX_CONTEXT
    assert conv["short"][1]["conversation_end"] == "done" and "conversation_end" not in conv["short"][0]
    led = read_ledger(params.run_dir)["datasets"]["d0"]
    assert led["conversation_ends"] == {"done": 1, "too_long": 1} and led["conversations"] == 2
    assert led["done"] == 3 and led["skipped"] == 1 and led["planned"] == 4 and led["skipped_ids"] == ["long"]
    assert led["rejected_prompt_lines"] == [f"d0:long#1: {end.split(': ', 2)[2]}"]
    view = conversation_turns(params.run_dir, "d0", "long")
    assert view["key"].tolist() == ["d0/long#0"] and view["conversation_end"].tolist() == [end]
    return led


def _check_inspector(params, tok) -> None:
    res = run_audit(params, progress=False, tokenizer=tok)
    html = inspect_record(res, "d0", "long", tok).html
    assert "1 journaled turns, ended: too_long: turn 1: prompt of" in html and NOT_ENDED not in html
    assert "ended: done" in inspect_record(res, "d0", "short", tok).html


def _check_resume(params, run, led: dict) -> None:
    """Resume: nothing is sent again, the ledger is the one of the run that cut it; with a larger max_context the
    conversation still is not continued (its last record says it ended)."""
    again = run(params)
    assert again.new_records == 0
    led2 = read_ledger(params.run_dir)["datasets"]["d0"]
    for k in ("conversation_ends", "planned", "done", "skipped", "skipped_ids", "rejected_prompt_lines"):
        assert led2[k] == led[k], k
    wider = params.model_copy(update={"model": params.model.model_copy(update={"max_context": 100_000})})
    more = run(wider)
    assert more.new_records == 0 and sorted(_turns(params)["long"]) == [0]
    assert read_ledger(params.run_dir)["datasets"]["d0"]["conversation_ends"] == {"done": 1, "too_long": 1}


def test_local_next_prompt_too_long_ends_the_conversation_in_its_last_record(qwen, tmp_path):
    params = _params(tmp_path, **{"generate.batch_size": 2})
    model = _Scripted(qwen)
    s = run_generate(params, progress=False, model=model, tokenizer=qwen)
    assert s.status == "finished" and s.new_records == 3 and model.calls == 3
    led = _check_too_long_run(params)
    _check_inspector(params, qwen)
    _check_resume(params, lambda p: run_generate(p, progress=False, model=model, tokenizer=qwen), led)
    assert model.calls == 3
    # a journal whose last record could not say it (written before this rule, or under a larger max_context):
    # resume finds the next prompt too long, counts it in the ledger, and writes no line (the journal is
    # append-only, and a second completed line of long#0 would be a duplicate)
    path = params.run_dir / "records" / "d0.jsonl"
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    for r in lines:
        if r["sample_id"] == "long":
            del r["conversation_end"]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    before = path.read_bytes()
    assert run_generate(params, progress=False, model=model, tokenizer=qwen).new_records == 0
    assert path.read_bytes() == before and model.calls == 3
    led3 = read_ledger(params.run_dir)["datasets"]["d0"]
    assert led3["conversation_ends"] == {"done": 1, "too_long": 1} and led3["skipped_ids"] == ["long"]
    assert led3["rejected_prompt_lines"] == led["rejected_prompt_lines"]


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_http_next_prompt_too_long_ends_the_conversation_in_its_last_record(qwen, tmp_path, monkeypatch, kind):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    srv_kw = {"model_path": "/models/target", "eot_id": QWEN3.end_of_turn.id} if kind == "sglang" else {}
    with LoopbackServer(kind, **srv_kw) as srv:
        if kind == "sglang":
            srv.script = lambda prompt_ids: _reply(qwen, prompt_ids)
            backend = {"generate.sglang": {"base_url": srv.base_url}}
        else:
            backend = {"generate.openai": {"base_url": srv.base_url, "model": "m", "api_key_env": KEY_ENV}}
        params = _params(tmp_path, **{"generate.backend": kind, "generate.timeout_s": 10, "generate.concurrency": 2,
                                      **backend})
        s = run_generate(params, progress=False, tokenizer=qwen)
        assert s.status == "finished" and s.new_records == 3
        led = _check_too_long_run(params)
        if kind == "sglang":  # exact ids: 03 audits them as they are (API records wait for 02's rebuilt ids)
            _check_inspector(params, qwen)
        _check_resume(params, lambda p: run_generate(p, progress=False, tokenizer=qwen), led)
        sent = [r for r in srv.requests if r["path"] in ("/generate", "/chat/completions")]
    assert len(sent) == 3  # long#1 was never sent, at the first run or at either resume
