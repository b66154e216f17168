"""The text of an output's spans, as an API returns it: the one decoding of `Profile.split_output`.

Exact backends (local, SGLang, vLLM) write a record's `reasoning`, `content` and `tool_calls`
with `output_texts`; 02 decodes exact records the same way to measure drift; 03's
`text.fields_match` compares the same decoding with the record's fields. So for every honest
record the text fields are, by construction, what the one split of its ids says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import orjson

from eagle3data.core.profiles import OutputSplit, Profile


@dataclass
class OutputText:
    """reasoning (None for a non-reasoning profile), content, and OpenAI-format tool calls (None when none)."""

    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]] | None


def parse_calls(call_texts: list[str], profile: Profile) -> list[dict[str, Any]] | None:
    """OpenAI-format tool calls from decoded native call bodies, as a server's tool parser returns them.

    Kimi: `functions.NAME:IDX<|tool_call_argument_begin|>{json}` (the id is kept as the call id);
    Qwen3: `{"name": ..., "arguments": {...}}`. None when any body does not parse.
    """
    tc = profile.tool_calls
    out = []
    for i, t in enumerate(call_texts):
        if tc is not None and tc.style == "kimi":
            ident, sep, args = t.partition(tc.argument_begin.text)  # type: ignore[union-attr]
            if not sep or not ident.startswith("functions.") or ":" not in ident:
                return None
            name = ident[len("functions."):].rsplit(":", 1)[0]
            out.append({"id": ident, "type": "function", "function": {"name": name, "arguments": args}})
        else:
            try:
                obj = orjson.loads(t.strip())
            except orjson.JSONDecodeError:
                return None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            args = json.dumps(obj.get("arguments", {}), ensure_ascii=False)
            out.append({"id": f"call_{i}", "type": "function", "function": {"name": obj["name"], "arguments": args}})
    return out


def _decode_many(tokenizer: Any, runs: list[list[int]]) -> list[str]:
    """Decode id runs in one batched call where the tokenizer has one (special tokens kept as text)."""
    bt = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if bt is not None and hasattr(bt, "decode_batch"):
        return bt.decode_batch(runs, skip_special_tokens=False) if runs else []
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def texts_of_splits(splits: Sequence[OutputSplit], profile: Profile, tokenizer: Any) -> list[OutputText]:
    """`OutputText` of each split, decoded in one batch."""
    runs: list[list[int]] = []
    for s in splits:
        runs.append(s.reasoning or [])
        runs.append(s.content)
        runs.extend(s.calls or [])
    texts = _decode_many(tokenizer, runs)
    out, j = [], 0
    for s in splits:
        reasoning, content = texts[j], texts[j + 1]
        j += 2
        n = len(s.calls or [])
        calls = parse_calls(texts[j:j + n], profile) if n else None
        j += n
        if n and calls is None:  # bodies that do not parse: a server hands the raw section back as content
            content = _decode_many(tokenizer, [s.content + _raw_section(s, profile)])[0]
        elif calls and profile.tool_calls is not None and profile.tool_calls.style == "qwen3" and content.endswith("\n"):
            content = content[:-1]  # the separator the native rendering puts before the first call
        out.append(OutputText(reasoning if s.reasoning is not None else None, content, calls))
    return out


def _raw_section(s: OutputSplit, profile: Profile) -> list[int]:
    tc = profile.tool_calls
    assert tc is not None and s.calls is not None
    ids: list[int] = [tc.section_begin.id] if tc.section_begin else []
    for c in s.calls:
        ids += [tc.call_begin.id] + c + [tc.call_end.id]
    return ids + ([tc.section_end.id] if tc.section_end else [])


def output_texts(output_ids: Sequence[int], profile: Profile, tokenizer: Any) -> OutputText:
    """The text fields of one output: reasoning, content and tool calls of `profile.split_output`."""
    return texts_of_splits([profile.split_output(output_ids)], profile, tokenizer)[0]


def output_texts_batch(outputs: Sequence[Sequence[int]], profile: Profile, tokenizer: Any) -> list[OutputText]:
    """`output_texts` of many outputs with one batched decode."""
    return texts_of_splits([profile.split_output(o) for o in outputs], profile, tokenizer)
