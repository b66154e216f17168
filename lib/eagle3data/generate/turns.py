"""Whole conversations, turn by turn, on-policy: the history of every turn is the model's own replies.

With `generate.turns: all`, a prompt's normalized `conversation` (every turn of the row, see
`prompts.Prompt`) is regenerated one assistant turn at a time. Turn t (0, 1, ...) is generated
from the conversation rendered with the model's **own** replies to turns < t: the assistant
message of turn t' is built from turn t''s record (`assistant_message`: its `reasoning`,
`content` and `tool_calls`, which the exact backends write through the one split of the
output ids, `spans.output_texts`). The chat template then renders that history as it renders
any (Qwen3 and Kimi drop the reasoning of turns before the last user message).

The dataset's conversation is read as exchanges: the messages that open it (system, user) and
the dataset's reply steps (each an assistant message and the tool results that follow it).
After the model's reply:

- **a tool call** (one or more): the dataset's step at the same place must call the same
  functions in the same order and have their results; those results are spliced in as the
  tool turn (their `tool_call_id` set to the model's call ids) and the next turn is generated
  from there. Otherwise the conversation ends with a recorded reason
  (`tool_call_unmatched`, `tool_call_mismatch`, `tool_result_missing`). Tool results are data,
  never executed.
- **an answer**: the next exchange's user messages follow; none left: the conversation is `done`.
- a reply cut by the length limit (`length`), an `abort` or an `error` ends it too, and so does
  `generate.max_turns`.
- from the run: `too_long` (the next turn's prompt reaches model.max_context: generate.py templates
  it before this turn's record is written) and `budget` (the dataset's token budget skips the next
  turn: counted in the ledger only, see docs/01 "Turns").

The reason is journaled on the conversation's last turn record (`conversation_end`; `budget`
excepted); at resume a journaled end is final, `max_turns` excepted (`Conversation.replay`).
A turn record's key is `SampleKey.of(record)` = `dataset/sample_id#turn`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any
from eagle3data.core.reader import RunView, SampleKey, read_run
from eagle3data.prompts.load import Prompt

def assistant_message(rec: dict[str, Any]) -> dict[str, Any]:
    """The assistant message a turn's record puts into later turns' history (what the model produced).

    `content` (empty text when none), `reasoning_content` when the record has reasoning (the key
    the Qwen3 and Kimi templates read), `tool_calls` when it called tools.
    """
    msg: dict[str, Any] = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning") is not None:
        msg["reasoning_content"] = rec["reasoning"]
    if rec.get("tool_calls"):
        msg["tool_calls"] = copy.deepcopy(rec["tool_calls"])
    return msg


HISTORY_REASONING = ("reasoning", "reasoning_content", "reasoning_details", "none")


def api_messages(messages: list[dict[str, Any]], field: str = "reasoning_content") -> list[dict[str, Any]]:
    """Messages as an OpenAI-style API takes them back: an earlier reply's reasoning (the history's
    `reasoning_content`) under `field` (see `HISTORY_REASONING`, docs/01 "Turns"), everything else as it is.

    `reasoning_details` sends OpenRouter's preserved-reasoning shape, one `reasoning.text` block with the
    reasoning's text (a record keeps the text, not the provider's blocks: no signature or encrypted data);
    `none` leaves it out.
    """
    if field not in HISTORY_REASONING:
        raise ValueError(f"history reasoning field {field!r}: expected one of {', '.join(HISTORY_REASONING)}")
    out = []
    for m in messages:
        if m.get("role") == "assistant" and "reasoning_content" in m:
            m = dict(m)
            text = m.pop("reasoning_content")
            if field == "reasoning_details":
                m[field] = [{"type": "reasoning.text", "text": text, "format": "unknown", "index": 0}]
            elif field != "none":
                m[field] = text
        out.append(m)
    return out


@dataclass
class Exchange:
    """The messages that open one exchange (system/user), then the dataset's reply steps:
    (assistant message, the tool results that follow it)."""

    ask: list[dict[str, Any]] = field(default_factory=list)
    steps: list[tuple[dict[str, Any], list[dict[str, Any]]]] = field(default_factory=list)


def exchanges(conversation: list[dict[str, Any]]) -> list[Exchange]:
    """A dataset conversation as exchanges (see `Exchange`)."""
    out = [Exchange()]
    for m in conversation:
        role = m.get("role")
        cur = out[-1]
        if role == "assistant":
            cur.steps.append((m, []))
        elif role == "tool":
            if cur.steps:
                cur.steps[-1][1].append(m)
            else:
                cur.ask.append(m)
        elif cur.steps:  # a user (or system) message after replies opens the next exchange
            out.append(Exchange([m]))
        else:
            cur.ask.append(m)
    return out


def _names(calls: list[dict[str, Any]] | None) -> list[str]:
    return [str((c.get("function") or {}).get("name")) for c in calls or [] if isinstance(c, dict)]


class Conversation:
    """One conversation while its turns are generated: the history of its next turn, and how it ended."""

    def __init__(self, prompt: Any, max_turns: int | None = None):
        self.prompt = prompt
        self.exchanges = exchanges(prompt.conversation or prompt.messages)
        self.max_turns = max_turns
        self.history: list[dict[str, Any]] = [dict(m) for m in self.exchanges[0].ask]
        self.turn = 0  # the next turn to generate
        self.e = self.s = 0  # the dataset's exchange and reply step the next turn stands at
        self.ended: str | None = None  # the end reason (with particulars) once the conversation is over

    @property
    def dataset(self) -> str:
        return self.prompt.dataset

    @property
    def sample_id(self) -> Any:
        return self.prompt.sample_id

    def turn_prompt(self) -> Any:
        """The next turn as a Prompt (its messages: the history so far, a copy)."""
        return Prompt(self.prompt.dataset, self.prompt.sample_id, copy.deepcopy(self.history), self.prompt.tools)

    def end(self, reason: str) -> str:
        self.ended = reason
        return reason

    def advance(self, rec: dict[str, Any]) -> str | None:
        """Take turn `self.turn`'s record into the history; the end reason when the conversation is over."""
        fr = rec.get("finish_reason")
        if fr not in ("stop", "length", "abort"):
            return self.end(f"error: turn {self.turn}: {rec.get('error') or fr}")
        if fr != "stop":
            return self.end(f"{fr}: turn {self.turn} ended with finish_reason {fr}: its reply cannot be continued")
        msg = assistant_message(rec)
        self.history.append(msg)
        t = self.turn
        self.turn += 1
        ex = self.exchanges[self.e]
        calls = msg.get("tool_calls")
        if calls:
            step = ex.steps[self.s] if self.s < len(ex.steps) else None
            ours = _names(calls)
            theirs = _names(step[0].get("tool_calls")) if step else []
            if not theirs:
                return self.end(f"tool_call_unmatched: turn {t} calls {', '.join(ours)}; the dataset has no tool "
                                "call at this point")
            if ours != theirs:
                return self.end(f"tool_call_mismatch: turn {t} calls {', '.join(ours)}; the dataset calls "
                                f"{', '.join(theirs)}")
            results = step[1]  # type: ignore[index]
            if len(results) < len(calls):
                return self.end(f"tool_result_missing: turn {t} calls {len(calls)} tool(s); the dataset has "
                                f"{len(results)} result(s)")
            for i, r in enumerate(results):
                r = dict(r)
                if i < len(calls) and calls[i].get("id") is not None:
                    r["tool_call_id"] = calls[i]["id"]
                self.history.append(r)
            self.s += 1
        else:
            self.e += 1
            self.s = 0
            if self.e >= len(self.exchanges):
                return self.end("done")
            self.history.extend(dict(m) for m in self.exchanges[self.e].ask)
        if self.max_turns is not None and self.turn >= self.max_turns:
            return self.end(f"max_turns: {self.turn} turn(s) generated (generate.max_turns)")
        return None

    def replay(self, rec: dict[str, Any]) -> str | None:
        """Take an already journaled turn's record in (resume): as `advance`, and where the record says the
        conversation ended (`conversation_end`) it ends there, with that reason, whatever this run would decide:
        a `too_long` end (the next turn's prompt reached model.max_context when the record was written) is
        final. Only `max_turns` is judged again, by this run's generate.max_turns (raise it to go on); the other
        reasons `advance` finds in the record itself."""
        end = self.advance(rec)
        journaled = rec.get("conversation_end")
        if end is None and isinstance(journaled, str) and end_kind(journaled) != "max_turns":
            end = self.end(journaled)
        return end


def end_kind(reason: str | None) -> str | None:
    """The kind of an end reason (its text before the first colon), as the ledger counts it."""
    return None if reason is None else reason.split(":", 1)[0]


def _source_of(msg: dict[str, Any], replies: list[dict[str, Any]]) -> str:
    """Where a history message came from: `turn K` (the model's reply of turn K), or its role (dataset text)."""
    if msg.get("role") == "assistant":
        k = next((k for k, r in enumerate(replies) if r == msg), None)
        return f"turn {k}" if k is not None else "assistant (NOT a journaled turn)"
    return str(msg.get("role"))


def conversation_turns(run: Any, dataset: str, sample_id: Any):
    """One conversation of a `turns: all` run, turn by turn (for the inspector): per turn its key, finish
    reason, prompt and output lengths and ids, where each message of its history came from (`turn K` for
    the model's own reply of turn K, else the dataset message's role), and how the conversation ended.

    `run` is a run folder or a `reader.RunView`; the turns are the records of the supersede rule.
    """
    import pandas as pd


    view = run if isinstance(run, RunView) else read_run(run, [dataset], rebuilt=False, verdicts=False)
    recs = sorted((r for r in view.records([dataset]) if str(r["sample_id"]) == str(sample_id)
                   and r.get("turn") is not None), key=lambda r: int(r["turn"]))
    replies: list[dict[str, Any]] = []
    rows = []
    for r in recs:
        hist = [_source_of(m, replies) for m in r.get("messages") or []]
        rows.append({"key": str(SampleKey.of(r)), "turn": int(r["turn"]), "finish_reason": r.get("finish_reason"),
                     "prompt_len": len(r.get("prompt_ids") or []),
                     "output_len": None if r.get("output_ids") is None else len(r["output_ids"]),
                     "history": ", ".join(hist), "conversation_end": r.get("conversation_end"),
                     "prompt_ids": r.get("prompt_ids"), "output_ids": r.get("output_ids")})
        replies.append(assistant_message(r))
    return pd.DataFrame(rows, columns=["key", "turn", "finish_reason", "prompt_len", "output_len", "history",
                                       "conversation_end", "prompt_ids", "output_ids"])

