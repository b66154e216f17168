"""02's assembly (pure text): one API turn laid out as the profile's model spells it, with its text flags.

`assemble_segments` lays out a turn (`ApiTurn`) as segments: reasoning-open unless the prompt
opened reasoning, reasoning, reasoning-close, content, native tool-call tokens, end-of-turn;
no reasoning block when the prompt's template closed reasoning (`prompt_reasoning_state`).
It flags what the text holds that its ids cannot be sure of (special-token text, U+FFFD, bad
tool calls) from the special texts of the profile and tokenizer (`special_texts_cached`,
once per pair). No tokenizer call is made here: encoding and verifying the segments is
`text.rebuild_batch`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import orjson

from eagle3data.core.profiles import Profile, Token
from eagle3data.rebuild.provider_tokens import fast_backend


@dataclass
class ApiTurn:
    """What an API returned for one prompt, plus what the rebuild needs around it."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    prompt_ids: list[int] | None = None
    billed_tokens: int | None = None
    billed_reasoning_tokens: int | None = None  # usage.completion_tokens_details.reasoning_tokens
    logprobs: dict[str, Any] | None = None  # choices[0].logprobs as the API returned it


def _special_texts(profile: Profile, tokenizer: Any = None) -> dict[str, Any]:
    """The profile's special texts by kind, the tokenizer's other added-token texts, and their first characters.

    `first` holds the first character of every special text, and U+FFFD: a text holding none
    of them (nearly every text: one or two C substring searches) needs no per-kind search.
    """
    eot = [profile.end_of_turn.text] + ([profile.guard.text] if profile.guard else [])
    reasoning = [t.text for t in (profile.reasoning_open, profile.reasoning_close) if t is not None]
    tools = [t.text for t in profile.tool_calls.tokens()] if profile.tool_calls else []
    added = [t for t in _added_texts(fast_backend(tokenizer)) if t not in set(eot + reasoning + tools)] if tokenizer is not None else []
    first = sorted({t[0] for t in eot + reasoning + tools + added if t} | {"\ufffd"})
    return {"eot": eot, "reasoning": reasoning, "tools": tools, "added": added, "first": first}


@functools.lru_cache(maxsize=8)
def _added_texts(bt: Any) -> tuple[str, ...]:
    """The text of every added or special token of a tokenizer."""
    try:
        return tuple(t.content for t in bt.get_added_tokens_decoder().values() if t.content)
    except AttributeError:  # not a `tokenizers.Tokenizer`
        return ()


def _has_any(text: str, needles: list[str]) -> bool:
    """True when any needle occurs in `text` (one C substring search per needle: the fastest test here)."""
    return any(map(text.__contains__, needles))


# (field, kind of special text found in it, flag), in the order flags are reported
_TEXT_FLAGS = [
    ("content", "eot", "content_has_end_of_turn"),
    ("content", "reasoning", "content_has_reasoning_token"),
    ("content", "tools", "content_has_tool_call_token"),
    ("content", "added", "content_has_added_token_text"),
    ("reasoning", "tools", "reasoning_has_tool_call_token"),
    ("reasoning", "reasoning", "reasoning_has_reasoning_token"),
    ("reasoning", "eot", "reasoning_has_end_of_turn"),
    ("reasoning", "added", "reasoning_has_added_token_text"),
]


def _text_flags(content: str, reasoning: str, sp: dict[str, Any]) -> list[str]:
    """Flags for special-token text and U+FFFD in the API text (one pattern search per field first)."""
    first = sp["first"]
    hit_c, hit_r = _has_any(content, first), _has_any(reasoning, first)
    if not (hit_c or hit_r):
        return []
    fields = {"content": content if hit_c else "", "reasoning": reasoning if hit_r else ""}
    out = [flag for field_, kind, flag in _TEXT_FLAGS if _has_any(fields[field_], sp[kind])]
    if hit_c and "\ufffd" in content:
        out.append("content_has_replacement_char")
    if hit_r and "\ufffd" in reasoning:
        out.append("reasoning_has_replacement_char")
    return out


def _call_parts(call: dict[str, Any]) -> tuple[str, str, str | None] | None:
    """(name, arguments JSON text, id) of an OpenAI-format tool call, or None when unusable."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return None
    args = fn.get("arguments", "{}")
    if isinstance(args, (dict, list)):
        args = orjson.dumps(args).decode()
    if not isinstance(args, str):
        return None
    cid = call.get("id") if isinstance(call.get("id"), str) else None
    return fn["name"], args, cid


def _render_tool_calls(calls: list[tuple[str, str, str | None]], profile: Profile, after_content: bool
                       ) -> list[tuple[str, Token | None]]:
    """Segments of the profile's native tool-call spelling (text, or a structural token)."""
    tc = profile.tool_calls
    assert tc is not None
    segs: list[tuple[str, Token | None]] = []
    if tc.style == "qwen3":
        for i, (name, args, _) in enumerate(calls):
            if after_content or i > 0:
                segs.append(("\n", None))
            segs.append((tc.call_begin.text, tc.call_begin))
            segs.append(('\n{"name": "' + name + '", "arguments": ' + args + "}\n", None))
            segs.append((tc.call_end.text, tc.call_end))
    elif tc.style == "kimi":
        assert tc.section_begin and tc.section_end and tc.argument_begin
        segs.append((tc.section_begin.text, tc.section_begin))
        for i, (name, args, cid) in enumerate(calls):
            ident = cid if cid and cid.startswith("functions.") else f"functions.{name}:{i}"
            segs += [(tc.call_begin.text, tc.call_begin), (ident, None), (tc.argument_begin.text, tc.argument_begin),
                     (args, None), (tc.call_end.text, tc.call_end)]
        segs.append((tc.section_end.text, tc.section_end))
    else:
        raise ValueError(f"profile {profile.name!r}: unknown tool-call style {tc.style!r}")
    return segs


def prompt_reasoning_state(prompt_ids: Sequence[int] | None, profile: Profile) -> str | None:
    """`open` when the generation prompt already opened reasoning, `closed` when it also closed it, else None.

    The generation prompt is what follows the prompt's last end-of-turn id: Kimi's ends with
    `<think>` (open); Qwen3 with thinking off ends with `<think>\\n\\n</think>\\n\\n` (closed).
    """
    ro, rc = profile.reasoning_open, profile.reasoning_close
    if not prompt_ids or ro is None or rc is None:
        return None
    eot, state = profile.end_of_turn.id, None
    for i in reversed(prompt_ids):
        if i == eot:
            break
        if i == rc.id and state is None:
            state = "closed"
        elif i == ro.id:
            return state or "open"
    return None


def _closed_before_cut(turn: ApiTurn, provider_closed: bool | None) -> bool:
    """A length cut with no content: do the provider's own tokens show the model closed its reasoning?

    Without them the cut is first taken to be inside the reasoning; `rebuild_batch` then
    moves it after the reasoning-close when the billed counts say so (`text._cut_after_close`).
    """
    return bool(provider_closed)


Seg = tuple[str, "Token | None", "str | None"]


def assemble(turn: ApiTurn, profile: Profile, *, append_guard: bool = False, tokenizer: Any = None
             ) -> tuple[list[tuple[str, Token | None]], list[str]]:
    """The turn as segments `(text, structural token or None)` in the model's order, and its flags.

    With `tokenizer`, the literal text of any of its added tokens is flagged too.
    """
    segs, flags, _ = assemble_segments(turn, profile, _special_texts(profile, tokenizer), append_guard)
    return [(t, tok) for t, tok, _ in segs], flags


def assemble_segments(turn: ApiTurn, profile: Profile, sp: dict[str, Any], append_guard: bool,
              keep: frozenset[str] = frozenset(), provider_closed: bool | None = None
              ) -> tuple[list[Seg], list[str], list[str]]:
    """`assemble` with the special texts computed once per batch: (segments, flags, the turn's text spans).

    Text segments are joined (the model never saw a seam between them) except those of the
    spans in `keep`, whose ids come from the provider.
    """
    flags: list[str] = []
    reasoning = turn.reasoning or ""
    content = turn.content or ""
    truncated = turn.finish_reason in ("length", "abort")
    if truncated:
        flags.append("truncated")
    calls: list[tuple[str, str, str | None]] = []
    for c in turn.tool_calls or []:
        parts = _call_parts(c)
        if parts is None:
            flags.append("bad_tool_call")
        else:
            calls.append(parts)
    if not (reasoning or content or calls):
        flags.append("empty_output")
    flags += _text_flags(content, reasoning, sp)

    segs: list[Seg] = []
    spans: list[str] = []
    if profile.is_reasoning:
        state = prompt_reasoning_state(turn.prompt_ids, profile)
        if state == "closed":  # the template closed reasoning: no block is invented
            flags.append("prompt_closed_reasoning")
            if reasoning:
                flags.append("reasoning_after_closed_prompt")
                segs.append((reasoning, None, "reasoning"))
        else:
            if not reasoning:
                flags.append("empty_reasoning")
            ro = profile.reasoning_open
            if ro is not None and state != "open":
                segs.append((ro.text, ro, None))
            if reasoning:
                segs.append((reasoning, None, "reasoning"))
            rc = profile.reasoning_close
            assert rc is not None
            if truncated and not content and not calls:
                if _closed_before_cut(turn, provider_closed):
                    flags.append("length_cut_after_reasoning")
                    segs.append((rc.text, rc, None))
                else:
                    flags.append("truncated_in_reasoning")  # the model never closed its reasoning
            else:
                segs.append((rc.text, rc, None))
    elif reasoning:
        segs.append((reasoning, None, "reasoning"))  # a non-reasoning profile has no place for it: kept, flagged by audit
    if reasoning:
        spans.append("reasoning")
    if content:
        segs.append((content, None, "content"))
        spans.append("content")
    if calls:
        spans.append("tools")
        if profile.tool_calls is None:
            flags.append("tool_calls_without_native_form")
        else:
            segs += [(t, tok, "tools") for t, tok in _render_tool_calls(calls, profile, after_content=bool(content))]
    if not truncated:
        segs.append((profile.end_of_turn.text, profile.end_of_turn, None))
        if append_guard and profile.guard is not None:
            segs.append((profile.guard.text, profile.guard, None))
    return _merge_text(segs, keep), flags, spans


def _merge_text(segs: list[Seg], keep: frozenset[str] = frozenset()) -> list[Seg]:
    """Join adjacent text segments (the model never saw a seam between them), except spans in `keep`."""
    out: list[Seg] = []
    for text, tok, span in segs:
        if tok is None and out and out[-1][1] is None and not (keep and (span in keep or out[-1][2] in keep)):
            out[-1] = (out[-1][0] + text, None, out[-1][2] if out[-1][2] == span else None)
        elif text:
            out.append((text, tok, span))
    return out


_SPECIAL_CACHE: dict[tuple[int, int], tuple[Any, Any, dict[str, Any]]] = {}


def special_texts_cached(profile: Profile, bt: Any) -> dict[str, Any]:
    """`_special_texts` once per (profile, tokenizer) object pair."""
    key = (id(profile), id(bt))
    hit = _SPECIAL_CACHE.get(key)
    if hit is None or hit[0] is not profile or hit[1] is not bt:
        if len(_SPECIAL_CACHE) > 32:
            _SPECIAL_CACHE.clear()
        hit = _SPECIAL_CACHE[key] = (profile, bt, _special_texts(profile, bt))
    return hit[2]
