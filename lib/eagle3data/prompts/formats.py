"""Dataset formats: one small normalizer per published prompt-dataset format.

A normalizer takes one row as the dataset publishes it (a dict: a JSON line, a parquet row)
and returns the project's form: OpenAI chat `messages` holding every turn of the row (the
dataset's own assistant replies included), OpenAI-format `tools` where the row declares
functions, the row's own id where the format has one, and a few card fields kept as
metadata. It raises `RowError(reason)` for a row it cannot read; the loader
(`prompts.load_prompts`) adds the location (`file:line` or `file row N`), drops the trailing
assistant turn for single-turn regeneration (its text kept as `meta.reference_reply`),
gives rows without an id a content hash of their prompt, and drops exact duplicates.

Which card fields each format reads is listed in `FORMATS[name].fields` and in docs/01
"Prompt datasets"; `python -m eagle3data prompts FILE --format NAME` shows what a file
turns into.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

ROLES = {"system", "user", "assistant", "tool"}


class RowError(ValueError):
    """A row the format cannot read; the message is the reason (the loader adds where)."""


@dataclass
class Normalized:
    """One row in the project's form, before the loader cuts the prompt out of it."""

    conversation: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    row_id: int | str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None  # the prompt as given (`prompts`); None: cut from conversation


@dataclass(frozen=True)
class DatasetFormat:
    """A published row shape and its normalizer."""

    name: str
    datasets: str  # the published datasets of this shape
    fields: str  # card fields read, as documented
    required: tuple[tuple[str, ...], ...]  # at least one of these field sets must be present
    normalize: Callable[[dict[str, Any]], Normalized]
    id_field: str | None = None
    drop_trailing_reply: bool = True  # `prompts` rows must already end with a user/tool turn

    def missing_fields(self, keys: set[str]) -> str | None:
        """Why a row with these top-level keys cannot be of this format, or None."""
        if any(set(group) <= keys for group in self.required):
            return None
        want = " or ".join("+".join(f"`{k}`" for k in g) for g in self.required)
        return f"format `{self.name}` reads {want}; the row has {', '.join(sorted(keys)) or 'no fields'}"


FORMATS: dict[str, DatasetFormat] = {}


def _register(name: str, datasets: str, fields: str, required: tuple[tuple[str, ...], ...],
              id_field: str | None = None, drop_trailing_reply: bool = True):
    def deco(fn: Callable[[dict[str, Any]], Normalized]) -> Callable[[dict[str, Any]], Normalized]:
        FORMATS[name] = DatasetFormat(name, datasets, fields, required, fn, id_field, drop_trailing_reply)
        return fn

    return deco


def get_format(name: str) -> DatasetFormat:
    if name not in FORMATS:
        raise KeyError(f"unknown dataset format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def guess_formats(keys: set[str]) -> list[str]:
    """Formats whose required fields a row with these keys has (for a hint in errors)."""
    return [f.name for f in FORMATS.values() if f.name != "prompts" and f.missing_fields(keys) is None]


def accepting_formats(rows: list[dict[str, Any]], *, exclude: str | None = None, most: int = 3,
                      reads: Callable[[DatasetFormat, dict[str, Any]], Any] | None = None) -> list[str]:
    """Registered formats that read these rows (for a "looks like format X" hint): the formats that read
    the most rows first, then those whose id field every row has, then registry order; at most `most`.
    `reads(format, row)` raises RowError for a row the format cannot use (default: its normalizer)."""
    ranked = []
    for order, f in enumerate(FORMATS.values()):
        if f.name == exclude:
            continue
        ok = 0
        for row in rows:
            try:
                (reads or (lambda fmt, r: fmt.normalize(r)))(f, row)
                ok += 1
            except (ValueError, TypeError, AttributeError, KeyError):  # RowError, or a shape it never expected
                continue
        if ok:
            ranked.append((-ok, not (f.id_field and all(f.id_field in r for r in rows)), order, f.name))
    return [name for *_, name in sorted(ranked)[:most]]


# ---------------------------------------------------------------- shared pieces


def _text(v: Any, what: str) -> str:
    """A turn's text: a string, or OpenAI content parts of type text (joined)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) for p in v):
        out = []
        for p in v:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise RowError(f"{what} has a content part of type {p.get('type')!r} (only text is read)")
            out.append(p["text"])
        return "".join(out)
    raise RowError(f"{what} must be a string, got {type(v).__name__}")


def _scalars(row: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """Card fields kept as metadata: only those present and plain (str/int/float/bool)."""
    return {k: row[k] for k in keys if isinstance(row.get(k), (str, int, float, bool)) and row.get(k) is not None}


def _tool_calls(v: Any, what: str) -> list[dict[str, Any]]:
    """OpenAI `tool_calls`, arguments as a JSON string (an object is serialized)."""
    if not isinstance(v, list) or not v:
        raise RowError(f"{what}.tool_calls must be a non-empty list")
    out = []
    for i, tc in enumerate(v):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowError(f"{what}.tool_calls[{i}].function.name is missing")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(tc.get("id"), str):
            call = {"id": tc["id"], **call}
        out.append(call)
    return out


def _openai_messages(msgs: Any, field_name: str = "messages") -> list[dict[str, Any]]:
    """OpenAI chat messages as published (role/content, assistant tool_calls, tool results)."""
    if not isinstance(msgs, list) or not msgs:
        raise RowError(f"field `{field_name}` must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        what = f"`{field_name}[{i}]`"
        if not isinstance(m, dict):
            raise RowError(f"{what} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise RowError(f"{what}.role must be one of {sorted(ROLES)}, got {role!r}")
        msg: dict[str, Any] = {"role": role}
        if role == "assistant" and m.get("tool_calls"):
            msg["content"] = "" if m.get("content") is None else _text(m["content"], f"{what}.content")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], what)
        else:
            if m.get("content") is None:
                raise RowError(f"{what}.content is missing")
            msg["content"] = _text(m["content"], f"{what}.content")
        if role == "tool":
            for k in ("tool_call_id", "name"):
                if isinstance(m.get(k), str):
                    msg[k] = m[k]
        out.append(msg)
    return out


def _tools(v: Any, what: str = "field `tools`") -> list[dict[str, Any]] | None:
    """OpenAI tools; a JSON string (as LLaMA-Factory's ShareGPT files store them) is parsed."""
    if v is None or v == "" or v == []:
        return None
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise RowError(f"{what} is a string that is not JSON ({e.msg})") from None
    if not isinstance(v, list):
        raise RowError(f"{what} must be a list")
    out = []
    for i, t in enumerate(v):
        if isinstance(t, dict) and "function" not in t and isinstance(t.get("name"), str):
            t = {"type": "function", "function": t}  # a bare function schema
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError(f"{what}[{i}].function.name is missing")
        out.append({"type": "function", "function": fn})
    return out


def _row_id(row: dict[str, Any], key: str) -> int | str | None:
    v = row.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, str)) or v == "":
        raise RowError(f"field `{key}` must be an integer or non-empty string, got {v!r}")
    return v


def _need_str(row: dict[str, Any], key: str) -> str:
    v = row.get(key)
    if not isinstance(v, str):
        raise RowError(f"field `{key}` must be a string, got {type(v).__name__}" if key in row
                       else f"missing field `{key}`")
    if not v.strip():
        raise RowError(f"field `{key}` is empty")
    return v


# ---------------------------------------------------------------- the formats


@_register("prompts", "this project's prompt files (`builtin:` sets, `prompts --out`)",
           "`sample_id`, `messages`, `tools`?, `conversation`?, `meta`?",
           (("sample_id", "messages"),), id_field="sample_id", drop_trailing_reply=False)
def _prompts(obj: dict[str, Any]) -> Normalized:
    """Today's strict JSONL: the prompt as sent, ending with a user or tool turn."""
    if "sample_id" not in obj:
        raise RowError("missing field `sample_id`")
    sid = obj["sample_id"]
    if isinstance(sid, bool) or not isinstance(sid, (int, str)) or sid == "":
        raise RowError(f"field `sample_id` must be an integer or non-empty string, got {sid!r}")
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RowError("field `messages` must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RowError(f"field `messages[{i}]` must be an object")
        if m.get("role") not in ROLES:
            raise RowError(f"field `messages[{i}].role` must be one of {sorted(ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise RowError(f"field `messages[{i}].content` must be a string")
    if msgs[-1]["role"] not in ("user", "tool"):
        raise RowError(f"field `messages` must end with a user or tool turn, ends with {msgs[-1]['role']!r}")
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RowError("field `tools` must be a list")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RowError(f"field `tools[{i}].function.name` is missing")
    extra = set(obj) - {"sample_id", "messages", "tools", "conversation", "meta"}
    if extra:
        raise RowError(f"unknown field(s) {', '.join(sorted(extra))}")
    conv = obj.get("conversation")
    if conv is not None:
        conv = _openai_messages(conv, "conversation")
    meta = obj.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise RowError("field `meta` must be an object")
    return Normalized(conv or msgs, tools, sid, dict(meta or {}), messages=msgs)


@_register("openai", "any file of OpenAI chat `messages` (the common export shape)",
           "`messages` (role/content, assistant `tool_calls`, `tool` turns with `tool_call_id`), `tools`?, "
           "`id` or `sample_id`?", (("messages",),), id_field="id")
def _openai(row: dict[str, Any]) -> Normalized:
    rid = _row_id(row, "id") if row.get("id") is not None else _row_id(row, "sample_id")
    return Normalized(_openai_messages(row.get("messages")), _tools(row.get("tools")), rid)


@_register("ultrachat", "HuggingFaceH4/ultrachat_200k (splits train_sft, test_sft, train_gen, test_gen)",
           "`prompt_id` (the id), `messages` (role/content, alternating user/assistant, ends with assistant); "
           "`prompt` is the first user turn and is not read", (("messages",),), id_field="prompt_id")
def _ultrachat(row: dict[str, Any]) -> Normalized:
    return Normalized(_openai_messages(row.get("messages")), None, _row_id(row, "prompt_id"))


@_register("mixture_of_thoughts", "open-r1/Mixture-of-Thoughts (configs all, code, math, science)",
           "`messages` (user, then an assistant turn holding `<think>…</think>` and the answer); "
           "`source`, `num_tokens` kept as metadata", (("messages",),))
def _mixture_of_thoughts(row: dict[str, Any]) -> Normalized:
    return Normalized(_openai_messages(row.get("messages")), None, None, _scalars(row, ("source", "num_tokens")))


SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool",
    "function_call": "function_call",
}


def _from_value_turns(turns: Any, field_name: str, system: str | None) -> list[dict[str, Any]]:
    """`[{from, value}]` turns (ShareGPT, OpenThoughts) as OpenAI messages."""
    if not isinstance(turns, list) or not turns:
        raise RowError(f"field `{field_name}` must be a non-empty list")
    out: list[dict[str, Any]] = []
    if system is not None and system.strip():
        out.append({"role": "system", "content": system})
    pending: list[dict[str, Any]] = []  # tool calls waiting for their results
    for i, t in enumerate(turns):
        what = f"`{field_name}[{i}]`"
        if not isinstance(t, dict):
            raise RowError(f"{what} must be an object")
        src = t.get("from", t.get("role"))
        role = SHAREGPT_ROLES.get(str(src).lower()) if isinstance(src, str) else None
        if role is None:
            raise RowError(f"{what}.from {src!r} is not a known speaker ({', '.join(sorted(SHAREGPT_ROLES))})")
        value = t.get("value", t.get("content"))
        if not isinstance(value, str):
            raise RowError(f"{what}.value must be a string")
        if role == "function_call":  # LLaMA-Factory's ShareGPT: the call as JSON text
            try:
                call = json.loads(value)
            except json.JSONDecodeError as e:
                raise RowError(f"{what} (function_call) is not JSON ({e.msg})") from None
            calls = call if isinstance(call, list) else [call]
            tcs = _tool_calls([{"function": c} for c in calls if isinstance(c, dict)] or [None], what)
            for k, tc in enumerate(tcs, start=len(pending) + 1):
                tc.setdefault("id", f"call_{i}_{k}")
            out.append({"role": "assistant", "content": "", "tool_calls": tcs})
            pending = list(tcs)
            continue
        if not value.strip() and role in ("user", "assistant"):
            raise RowError(f"{what} ({src}) has an empty value")
        msg: dict[str, Any] = {"role": role, "content": value}
        if role == "tool" and pending:
            tc = pending.pop(0)
            msg["tool_call_id"], msg["name"] = tc["id"], tc["function"]["name"]
        out.append(msg)
    return out


@_register("sharegpt", "ShareGPT dumps (e.g. anon8231489123/ShareGPT_Vicuna_unfiltered), LLaMA-Factory ShareGPT",
           "`id`?, `conversations` (`from` human/gpt/system, also tool/observation/function_call; `value`), "
           "`system`?, `tools`? (JSON text)", (("conversations",),), id_field="id")
def _sharegpt(row: dict[str, Any]) -> Normalized:
    system = row.get("system") if isinstance(row.get("system"), str) else None
    conv = _from_value_turns(row.get("conversations"), "conversations", system)
    return Normalized(conv, _tools(row.get("tools")), _row_id(row, "id"))


@_register("openthoughts", "open-thoughts/OpenThoughts-114k (default config)",
           "`system` (the reasoning-format instruction), `conversations` (`from` user/assistant, `value`)",
           (("conversations",),))
def _openthoughts(row: dict[str, Any]) -> Normalized:
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise RowError("field `system` must be a string")
    return Normalized(_from_value_turns(row.get("conversations"), "conversations", system))


@_register("opencodeinstruct", "nvidia/OpenCodeInstruct",
           "`id`, `input` (the question), `output` (the reference solution); `domain`, "
           "`generation_algorithm`, `average_test_score` kept as metadata", (("input", "output"), ("input",)),
           id_field="id")
def _opencodeinstruct(row: dict[str, Any]) -> Normalized:
    conv = [{"role": "user", "content": _need_str(row, "input")}]
    if isinstance(row.get("output"), str) and row["output"].strip():
        conv.append({"role": "assistant", "content": row["output"]})
    return Normalized(conv, None, _row_id(row, "id"),
                      _scalars(row, ("domain", "generation_algorithm", "average_test_score")))


@_register("magicoder", "ise-uiuc/Magicoder-OSS-Instruct-75K (`problem`/`solution`), "
           "ise-uiuc/Magicoder-Evol-Instruct-110K and -OSS-Instruct-75K-Instruction-Response (`instruction`/`response`)",
           "`problem`+`solution` or `instruction`+`response`; `lang`, `index` kept as metadata",
           (("problem",), ("instruction",)))
def _magicoder(row: dict[str, Any]) -> Normalized:
    if "problem" in row:
        q, a = "problem", "solution"
    elif "instruction" in row:
        q, a = "instruction", "response"
    else:
        raise RowError("missing field `problem` (OSS-Instruct) or `instruction` (Evol-Instruct)")
    conv = [{"role": "user", "content": _need_str(row, q)}]
    if isinstance(row.get(a), str) and row[a].strip():
        conv.append({"role": "assistant", "content": row[a]})
    return Normalized(conv, None, None, _scalars(row, ("lang", "index")))


SWE_ROLES = {"system": "system", "user": "user", "ai": "assistant", "assistant": "assistant",
             "tool": "tool", "observation": "tool"}


@_register("swe_agent", "nebius/SWE-agent-trajectories",
           "`trajectory` (`role` system/user/ai, `text`, `system_prompt`; environment observations are `user` "
           "turns: the agent does not use function calling); `instance_id`, `model_name`, `target`, "
           "`exit_status` kept as metadata", (("trajectory",),))
def _swe_agent(row: dict[str, Any]) -> Normalized:
    traj = row.get("trajectory")
    if isinstance(traj, str):  # some exports store the list as JSON text
        try:
            traj = json.loads(traj)
        except json.JSONDecodeError as e:
            raise RowError(f"field `trajectory` is a string that is not JSON ({e.msg})") from None
    if not isinstance(traj, list) or not traj:
        raise RowError("field `trajectory` must be a non-empty list")
    conv = []
    for i, step in enumerate(traj):
        what = f"`trajectory[{i}]`"
        if not isinstance(step, dict):
            raise RowError(f"{what} must be an object")
        role = SWE_ROLES.get(step.get("role")) if isinstance(step.get("role"), str) else None
        if role is None:
            raise RowError(f"{what}.role {step.get('role')!r} is not one of system, user, ai")
        text = step.get("text")
        if role == "system" and not (isinstance(text, str) and text.strip()):
            text = step.get("system_prompt")
        if not isinstance(text, str):
            raise RowError(f"{what}.text must be a string")
        conv.append({"role": role, "content": text})
    return Normalized(conv, None, None, _scalars(row, ("instance_id", "model_name", "target", "exit_status")))


# glaive: "SYSTEM: …functions. Use them if required -\n{json}\n\n{json}" and
# "USER: … ASSISTANT: <functioncall> {"name": …, "arguments": '{…}'} <|endoftext|> FUNCTION RESPONSE: {…} …"
_GLAIVE_TURN = re.compile(r"(?:^|\n)[ \t]*(USER|ASSISTANT|FUNCTION RESPONSE)[ \t]*:[ \t]?")
_GLAIVE_CALL = re.compile(r'^\s*\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"arguments"\s*:\s*(?P<args>.*)\}\s*$', re.S)


def _glaive_tools(system: str) -> tuple[str, list[dict[str, Any]] | None]:
    """The system text before the function JSON, and the functions as OpenAI tools."""
    text = re.sub(r"^\s*SYSTEM\s*:\s*", "", system)
    start = text.find("{")
    if start < 0:
        return text.strip(), None
    head, body = text[:start].rstrip().rstrip("-").rstrip(), text[start:]
    dec = json.JSONDecoder()
    tools, pos = [], 0
    while pos < len(body):
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos >= len(body):
            break
        try:
            fn, pos = dec.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            raise RowError(f"field `system`: function definition is not JSON ({e.msg} at char {start + e.pos})") from None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError("field `system`: a function definition has no `name`")
        tools.append({"type": "function", "function": fn})
    return head, tools


def _glaive_call(text: str, turn: int) -> dict[str, Any]:
    """`{"name": "f", "arguments": '{"a": 1}'}` (arguments single-quoted, as published) -> a tool call."""
    name, args = None, None
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            name, args = obj.get("name"), obj.get("arguments", {})
    except json.JSONDecodeError:
        m = _GLAIVE_CALL.match(text)
        if m:
            name, raw = m["name"], m["args"].strip()
            if len(raw) >= 2 and raw[0] == raw[-1] == "'":
                raw = raw[1:-1]
            try:
                args = json.loads(raw)
            except json.JSONDecodeError:
                args = None
    if not isinstance(name, str) or not name:
        raise RowError(f"ASSISTANT turn {turn}: <functioncall> is not a {{\"name\", \"arguments\"}} object")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict):
        raise RowError(f"ASSISTANT turn {turn}: <functioncall> {name!r} arguments are not a JSON object")
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


@_register("glaive", "glaiveai/glaive-function-calling-v2",
           "`system` (\"SYSTEM: …\" then the function definitions as JSON objects), `chat` (USER:/ASSISTANT:/"
           "FUNCTION RESPONSE: turns, `<functioncall> {name, arguments}`, `<|endoftext|>` ends a reply)",
           (("system", "chat"), ("chat",)))
def _glaive(row: dict[str, Any]) -> Normalized:
    chat = _need_str(row, "chat")
    system = row.get("system") or ""
    if not isinstance(system, str):
        raise RowError("field `system` must be a string")
    head, tools = _glaive_tools(system)
    conv: list[dict[str, Any]] = [{"role": "system", "content": head}] if head else []
    parts = _GLAIVE_TURN.split(chat)
    if parts[0].strip():
        raise RowError("field `chat` must start with a USER: turn")
    calls = 0
    last_call: dict[str, Any] | None = None
    for k in range(1, len(parts), 2):
        who, text = parts[k], parts[k + 1].replace("<|endoftext|>", "").strip()
        turn = k // 2 + 1
        if who == "USER":
            if not text:
                raise RowError(f"USER turn {turn} is empty")
            conv.append({"role": "user", "content": text})
        elif who == "ASSISTANT":
            if "<functioncall>" in text:
                before, _, call_text = text.partition("<functioncall>")
                calls += 1
                call = {"id": f"call_{calls}", **_glaive_call(call_text, turn)}
                conv.append({"role": "assistant", "content": before.strip(), "tool_calls": [call]})
                last_call = call
            else:
                conv.append({"role": "assistant", "content": text})
        else:  # FUNCTION RESPONSE
            msg: dict[str, Any] = {"role": "tool", "content": text}
            if last_call is not None:
                msg["tool_call_id"], msg["name"] = last_call["id"], last_call["function"]["name"]
            conv.append(msg)
    if not any(m["role"] == "user" for m in conv):
        raise RowError("field `chat` has no USER: turn")
    return Normalized(conv, tools)
