"""02's rebuild: one assistant turn from API text, encoded in one batch and graded by what is proven.

`rebuild_batch` assembles each turn the way the profile's model spells it (reasoning-open
unless the prompt opened reasoning, reasoning, reasoning-close, content, native tool-call
tokens, end-of-turn; no reasoning block when the prompt's template closed reasoning), encodes
all turns with one batched tokenizer call (spans the provider gave per-token output for keep
the provider's ids: `provider_tokens`), and verifies each with checks named for what they
prove. `FLAGS` and `PROOF_LEVELS` say what a rebuilt record can carry. The stage around it
(calibration, drift, files) is `reconstruct.py`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import orjson

from eagle3data.core.profiles import Profile, Token
from eagle3data.rebuild.provider_tokens import fast_backend

# Flags a rebuilt record can carry. Informational ones describe the record; the others are
# problems for 03_audit to judge (the rebuild never repairs the text).
FLAGS: dict[str, str] = {
    "truncated": "finish_reason is length/abort: no end-of-turn appended",
    "truncated_in_reasoning": "cut inside reasoning: no reasoning-close appended either",
    "length_cut_after_reasoning": "length cut with empty content, but the billed reasoning tokens (or the provider's "
                                  "tokens) show the model closed its reasoning: the reasoning-close is kept",
    "empty_reasoning": "reasoning profile but the reasoning text is empty",
    "empty_output": "no reasoning, content or tool calls at all",
    "prompt_closed_reasoning": "the prompt's template already closed reasoning (thinking off): no reasoning block added",
    "reasoning_after_closed_prompt": "the prompt closed reasoning, yet the API returned reasoning text (kept as plain "
                                     "text before the content: the ids cannot be the model's)",
    "content_has_end_of_turn": "content holds the end-of-turn (or guard) token",
    "content_has_reasoning_token": "content holds a reasoning-open/close token",
    "content_has_tool_call_token": "content holds raw tool-call tokens (kept as they are)",
    "reasoning_has_tool_call_token": "reasoning holds a tool-call token",
    "reasoning_has_reasoning_token": "reasoning holds a reasoning-open/close token",
    "reasoning_has_end_of_turn": "reasoning holds the end-of-turn (or guard) token",
    "content_has_added_token_text": "content holds the literal text of another added/special token of the tokenizer "
                                    "(e.g. <|im_start|>, <|endoftext|>, <tool_response>, fill-in-middle): it "
                                    "encodes as that token's id, which the model may not have emitted",
    "reasoning_has_added_token_text": "reasoning holds the literal text of another added/special token of the tokenizer",
    "content_has_replacement_char": "content holds U+FFFD: the engine emitted bytes that are not valid UTF-8 there; "
                                    "the text lost them, so no rebuild from text can be the model's ids",
    "reasoning_has_replacement_char": "reasoning holds U+FFFD (see content_has_replacement_char)",
    "tool_calls_without_native_form": "structured tool calls, but the profile has no tool-call tokens: not rendered",
    "bad_tool_call": "a tool call without a function name or with unusable arguments",
    "structure_token_split": "a structural token (think, tool-call, end-of-turn) did not encode as its own single id "
                             "on its span: the tokenizer has an added token overlapping it (a profile/tokenizer "
                             "mismatch; cannot happen on the shipped Qwen3/SmolLM2/Kimi vocabularies)",
    "roundtrip_mismatch": "decode(ids) differs from the assembled text (e.g. NFC normalization): the ids do not spell it",
    "no_billed_count": "the API billed no completion_tokens to compare with",
    "count_outside_tolerance": "rebuilt length differs from billed tokens (+ the calibrated offset) by more than "
                               "reconstruct.count_tolerance of them",
    "count_off_offset": "rebuilt length minus billed completion tokens is not the calibrated offset of its "
                        "(provider, dataset, end): a token more or less than the model produced",
    "reasoning_count_off_offset": "rebuilt reasoning span minus billed reasoning tokens is not the calibrated offset",
    "provider_tokens_unusable": "the API returned per-token output that does not map to the tokenizer's ids or does "
                                "not spell the text: rebuilt from text instead",
    "prompt_templated_here": "the record had no prompt_ids: templated from its messages",
}

# Proof levels, weakest first. `engine` records come from the journal (02 never writes them).
PROOF_LEVELS: tuple[str, ...] = ("failed", "text", "count", "token", "engine")
PROOF_RANK: dict[str, int] = {lv: i for i, lv in enumerate(PROOF_LEVELS)}
PROOF_MEANING: dict[str, str] = {
    "engine": "the ids an engine produced (local, SGLang, vLLM with token ids): nothing rebuilt",
    "token": "every text span's ids are the provider's own tokens (logprobs), mapped to ids and proven to spell the "
             "text; only structural tokens (think, end-of-turn) are placed by the profile; billed counts agree",
    "count": "rebuilt by re-tokenizing: the ids spell the text, the billed completion count equals the rebuilt length "
             "after the (provider, dataset) offset, the billed reasoning count agrees where reported, and nothing "
             "risky is in the text. A same-count resplit (H+AVING vs HAV+ING) is still possible: drift by level "
             "measures how often",
    "text": "only that the ids spell the API text: the count is off its offset or not billed, or the text holds "
            "something its ids cannot be sure of (U+FFFD, the literal text of a special token, reasoning after a "
            "closed prompt)",
    "failed": "the ids do not spell the returned text, or the response cannot be rendered (empty, bad or "
              "unrenderable tool calls)",
}
_FAILED_FLAGS = frozenset({"roundtrip_mismatch", "empty_output", "bad_tool_call", "tool_calls_without_native_form"})
_RISKY_FLAGS = frozenset({
    "content_has_end_of_turn", "content_has_reasoning_token", "content_has_tool_call_token",
    "reasoning_has_tool_call_token", "reasoning_has_reasoning_token", "reasoning_has_end_of_turn",
    "content_has_added_token_text", "reasoning_has_added_token_text", "content_has_replacement_char",
    "reasoning_has_replacement_char", "structure_token_split", "reasoning_after_closed_prompt",
})
_CALIBRATED_FLAGS = ("count_outside_tolerance", "count_off_offset", "reasoning_count_off_offset")


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


@dataclass
class Rebuilt:
    """One rebuilt assistant turn, its verification and its proof level (`grade`)."""

    output_ids: list[int]
    text: str
    flags: list[str]
    seam_ok: bool
    seam_first_diff: int | None
    roundtrip_ok: bool
    billed_tokens: int | None
    count_diff: int | None
    billed_reasoning: int | None = None
    reasoning_rebuilt: int | None = None  # ids of the reasoning span (without open/close)
    reasoning_diff: int | None = None
    token_exact_spans: list[str] = field(default_factory=list)  # spans whose ids are the provider's tokens
    needed_spans: list[str] = field(default_factory=list)  # text spans of the turn ("tools": never token-exact)
    proof_level: str = "text"
    checks: dict[str, Any] = field(default_factory=dict)
    count_offset: int = 0
    reasoning_offset: int | None = 0
    count_tolerance: float = 0.02

    def grade(self, count_offset: int = 0, reasoning_offset: int | None = 0) -> "Rebuilt":
        """Set the count flags against the offsets, the checks (named for what they prove) and the proof level."""
        fl = [f for f in self.flags if f not in _CALIBRATED_FLAGS]
        count_ok = None if self.count_diff is None else self.count_diff == count_offset
        if count_ok is False:
            if abs(self.count_diff - count_offset) > self.count_tolerance * max(self.billed_tokens or 0, 1):
                fl.append("count_outside_tolerance")
            fl.append("count_off_offset")
        r_ok = (None if self.reasoning_diff is None or reasoning_offset is None
                else self.reasoning_diff == reasoning_offset)
        if r_ok is False:
            fl.append("reasoning_count_off_offset")
        exact = set(self.token_exact_spans)
        risky = bool(fl) and any(f in _RISKY_FLAGS and f.partition("_has_")[0] not in exact for f in fl)
        if fl and any(f in _FAILED_FLAGS for f in fl):
            level = "failed"
        elif self.needed_spans and exact.issuperset(self.needed_spans) and not risky and count_ok is not False \
                and r_ok is not False:
            level = "token"
        elif count_ok and r_ok is not False and not risky:
            level = "count"
        else:
            level = "text"
        self.flags, self.proof_level = fl, level
        self.count_offset, self.reasoning_offset = count_offset, reasoning_offset
        self.checks = {"ids_spell_text": self.roundtrip_ok, "structure_tokens_whole": self.seam_ok,
                       "count_on_offset": count_ok, "reasoning_count_on_offset": r_ok,
                       "spans_from_provider": sorted(exact)}
        return self


# ---------------------------------------------------------------- assembly (pure text)


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
    moves it after the reasoning-close when the billed counts say so (`_cut_after_close`).
    """
    return bool(provider_closed)


def _cut_after_close(turn: ApiTurn, n_ids: int, n_reasoning: int | None) -> bool:
    """A cut taken to be inside the reasoning really fell right after the reasoning-close.

    True when the API billed exactly one completion token more than the rebuild holds and
    the billed reasoning tokens equal the rebuilt reasoning span: the extra token is not
    reasoning, and the only token the model can emit there is the close. Without the billed
    reasoning tokens this cannot be told from a resplit inside the reasoning (the count
    check then flags the record).
    """
    c, r = turn.billed_tokens, turn.billed_reasoning_tokens
    return c is not None and r is not None and n_reasoning is not None and c - n_ids == 1 and n_reasoning == r


# A segment of an assembled turn: (text, structural token or None, span: "reasoning"/"content"/"tools"/None)
Seg = tuple[str, "Token | None", "str | None"]


def assemble(turn: ApiTurn, profile: Profile, *, append_guard: bool = False, tokenizer: Any = None
             ) -> tuple[list[tuple[str, Token | None]], list[str]]:
    """The turn as segments `(text, structural token or None)` in the model's order, and its flags.

    With `tokenizer`, the literal text of any of its added tokens is flagged too.
    """
    segs, flags, _ = _assemble(turn, profile, _special_texts(profile, tokenizer), append_guard)
    return [(t, tok) for t, tok, _ in segs], flags


def _assemble(turn: ApiTurn, profile: Profile, sp: dict[str, Any], append_guard: bool,
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


# ---------------------------------------------------------------- batched encode + verify


def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two id lists differ (the shorter length if one is a prefix), or None."""
    n = min(len(a), len(b))
    if n:
        x = np.asarray(a[:n]) != np.asarray(b[:n])
        if x.any():
            return int(np.argmax(x))
    return None if len(a) == len(b) else n


def _join(segs: Sequence[Sequence[Any]]) -> tuple[str, list[tuple[int, int, int]]]:
    """The assembled text and its seams: `(start, end, id)` character span of each structural token."""
    seams: list[tuple[int, int, int]] = []
    pos = 0
    for seg in segs:
        text, tok = seg[0], seg[1]
        if tok is not None:
            seams.append((pos, pos + len(text), tok.id))
        pos += len(text)
    return "".join(seg[0] for seg in segs), seams


def _seams_hold(enc: Any, ids: list[int], seams: list[tuple[int, int, int]]) -> bool:
    """True when each seam's first token is its structural id with exactly its span (no offsets list built)."""
    for start, end, tid in seams:
        k = enc.char_to_token(start)
        if k is None or ids[k] != tid or enc.token_to_chars(k) != (start, end):
            return False
    return True


def _seam_by_offsets(seams: list[tuple[int, int, int]], ids: list[int], offsets: list[tuple[int, int]]
                     ) -> int | None:
    """None when every structural token sits as its single id exactly on its seam, else a token index.

    The tokenizer splits its input at added tokens before normalizing and pre-tokenizing, so
    when each seam token is found whole at its own span, the text between seams was encoded
    exactly as if alone: the parts' ids concatenated equal the whole's ids.
    """
    starts = np.array([o[0] for o in offsets], dtype=np.int64)
    for pos, end, tid in seams:
        k = int(np.searchsorted(starts, pos, side="left"))
        while k < len(ids) and starts[k] == pos and not (ids[k] == tid and offsets[k][1] == end):
            k += 1
        if k >= len(ids) or starts[k] != pos:
            return min(int(np.searchsorted(starts, pos, side="left")), len(ids))
    return None


def _seam_diff_by_offsets(enc: Any, ids: list[int], seams: list[tuple[int, int, int]]) -> int | None:
    """`_seam_by_offsets` with a fast path: most records pass `_seams_hold`, which needs no offsets list."""
    if _seams_hold(enc, ids, seams):
        return None
    return _seam_by_offsets(seams, ids, enc.offsets)


# Batches at least this big check the roundtrip against a per-id byte table (below) instead of
# `decode_batch`: building and proving the table costs ~0.6 s once per 150k-id vocabulary (cached
# per tokenizer); it then checks 2.2M tokens in ~0.16 s of one core where `decode_batch` takes
# ~0.7 s of CPU (0.35 s wall on two cores).
BYTE_TABLE_MIN_RECORDS = 4096


@functools.lru_cache(maxsize=4)
def _byte_table(bt: Any) -> list[bytes] | None:
    """Each id's bytes exactly as the tokenizer's ByteLevel decoder emits them, or None.

    A ByteLevel decoder maps every character of every token back through the GPT-2 byte
    alphabet, joins the bytes and decodes them as UTF-8, so for valid text `decode(ids) ==
    text` exactly when the ids' bytes joined equal `text.encode()`. None when the decoder is
    anything else, or when any id's table entry disagrees with `decode([id])` (checked for the
    whole vocabulary, in one batch): then the caller uses `decode_batch`.
    """
    from tokenizers import decoders

    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # the GPT-2 byte alphabet
    except ImportError:  # moved in some transformers version: decode_batch still works
        return None
    if not isinstance(bt.decoder, decoders.ByteLevel):
        return None
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    table: list[bytes] = []
    for i in range(bt.get_vocab_size(with_added_tokens=True)):
        token = bt.id_to_token(i) or ""
        try:
            table.append(bytes(map(byte_of.__getitem__, token)))
        except KeyError:  # the decoder passes such a token through as its UTF-8 text
            table.append(token.encode())
    singles = bt.decode_batch([[i] for i in range(len(table))], skip_special_tokens=False)
    if any(d != b.decode("utf-8", "replace") for d, b in zip(singles, table)):
        return None
    return table


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a batch is built (it makes no cycles).

    Building ~10 small lists and tuples per record makes the collector rescan every live
    container again and again; that was a third of the assembly time at 10k records.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _reasoning_count(enc: Any, ids: list[int], seams: list[tuple[int, int, int]], profile: Profile) -> int | None:
    """Ids of the reasoning span in a whole encoding: between the reasoning-open seam (or the start) and the close."""
    ro, rc = profile.reasoning_open, profile.reasoning_close
    start = 1 if seams and ro is not None and seams[0][0] == 0 and seams[0][2] == ro.id else 0
    for pos, _, tid in seams:
        if rc is not None and tid == rc.id:
            k = enc.char_to_token(pos)
            return None if k is None else k - start
    return len(ids) - start


def rebuild_batch(turns: Sequence[ApiTurn], tokenizer: Any, profile: Profile, *, count_tolerance: float = 0.02,
                  seam_check: str = "offsets", append_guard: bool = False, count_offset: int = 0,
                  reasoning_offset: int | None = 0) -> list[Rebuilt]:
    """Rebuild, verify and grade many turns with one batched encode.

    `seam_check="offsets"` proves the structural tokens whole from the whole encoding's
    offsets (no second encode); `"reencode"` also encodes every text part on its own and
    compares ids. The roundtrip uses one `decode_batch`, or for big batches the tokenizer's
    byte table. Turns with per-token provider output (`logprobs`) take the ids of the spans
    those tokens spell from the provider (`provider_tokens.span_ids`) and encode only the
    rest. Each result is graded against `count_offset` / `reasoning_offset` (the run stage
    grades again with the offsets it calibrates).
    """
    if seam_check not in ("offsets", "reencode"):
        raise ValueError(f"seam_check must be 'offsets' or 'reencode', got {seam_check!r}")
    bt = fast_backend(tokenizer)
    sp = _special_texts_cached(profile, bt)
    table = _byte_table(bt) if len(turns) >= BYTE_TABLE_MIN_RECORDS else None
    with _gc_paused():
        provided = _provider_spans(turns, tokenizer, profile)
        assembled = [_assemble(t, profile, sp, append_guard) if p is None else
                     _assemble(t, profile, sp, append_guard, frozenset(p.ids), p.reasoning_closed)
                     for t, p in zip(turns, provided)]
        plain = [i for i, p in enumerate(provided) if p is None or not p.ids]
        joined = [_join(assembled[i][0]) for i in plain]
        texts = [t for t, _ in joined]
        encs = bt.encode_batch(texts, add_special_tokens=False)
        all_ids = [e.ids for e in encs]
        if table is None:
            decoded = bt.decode_batch(all_ids, skip_special_tokens=False)
        else:  # bytes compared; a record that fails is decided by the tokenizer's own decode
            byte = table.__getitem__
            decoded = [text if b"".join(map(byte, ids)) == text.encode() else bt.decode(ids, skip_special_tokens=False)
                       for text, ids in zip(texts, all_ids)]
        part_ids: list[list[int]] | None = None
        if seam_check == "reencode":
            flat = [s for i in plain for s, tok, _ in assembled[i][0] if tok is None]
            part_ids = [e.ids for e in bt.encode_batch_fast(flat, add_special_tokens=False)] if flat else []
        out: list[Rebuilt | None] = [None] * len(turns)
        j = 0
        for i, (text, seams), enc, ids, dec in zip(plain, joined, encs, all_ids, decoded):
            segs, flags, spans = assembled[i]
            turn = turns[i]
            if provided[i] is not None and provided[i].problem:  # type: ignore[union-attr]
                flags.append("provider_tokens_unusable")
            if part_ids is not None:
                concat: list[int] = []
                for s, tok, _ in segs:
                    if tok is None:
                        concat += part_ids[j]
                        j += 1
                    else:
                        concat.append(tok.id)
                seam_diff = first_diff(concat, ids)
            else:
                seam_diff = _seam_diff_by_offsets(enc, ids, seams) if seams else None
            n_r = (_reasoning_count(enc, ids, seams, profile)
                   if turn.billed_reasoning_tokens is not None and "reasoning" in spans and profile.is_reasoning
                   and "prompt_closed_reasoning" not in flags else None)
            ok = dec == text
            if "truncated_in_reasoning" in flags and _cut_after_close(turn, len(ids), n_r):
                rc = profile.reasoning_close
                assert rc is not None
                ids, text = ids + [rc.id], text + rc.text  # decode(ids + [close]) == decode(ids) + its text
                flags[flags.index("truncated_in_reasoning")] = "length_cut_after_reasoning"
            out[i] = _verified(turn, ids, text, flags, spans, seam_diff, ok, n_r, [], count_tolerance)
        rest = [i for i in range(len(turns)) if out[i] is None]
        if rest:
            _rebuild_with_provider_ids(rest, turns, assembled, provided, bt, out, count_tolerance, profile)
        return [rb.grade(count_offset, reasoning_offset) for rb in out]  # type: ignore[union-attr]


def _verified(turn: ApiTurn, ids: list[int], text: str, flags: list[str], spans: list[str], seam_diff: int | None,
              roundtrip_ok: bool, n_reasoning: int | None, exact: list[str], count_tolerance: float) -> Rebuilt:
    """A `Rebuilt` with its seam, roundtrip and count facts (graded by the caller)."""
    if seam_diff is not None:
        flags.append("structure_token_split")
    if not roundtrip_ok:
        flags.append("roundtrip_mismatch")
    billed = turn.billed_tokens
    diff = None
    if billed is None:
        flags.append("no_billed_count")
    else:
        diff = len(ids) - billed  # flagged by `grade`, against the offset (count_outside_tolerance, count_off_offset)
    br = turn.billed_reasoning_tokens
    if br == 0 and n_reasoning:  # many providers report 0 where they do not count reasoning: no information
        br = None
    r_diff = n_reasoning - br if n_reasoning is not None and br is not None else None
    return Rebuilt(ids, text, flags, seam_diff is None, seam_diff, roundtrip_ok, billed, diff, br, n_reasoning, r_diff,
                   exact, spans, count_tolerance=count_tolerance)


def _provider_spans(turns: Sequence[ApiTurn], tokenizer: Any, profile: Profile) -> list[Any]:
    """`provider_tokens.span_ids` of each turn that carries per-token output (None for the others)."""
    if not any(t.logprobs for t in turns):
        return [None] * len(turns)
    from eagle3data.rebuild.provider_tokens import span_ids

    return [span_ids(t.logprobs, t.reasoning, t.content, profile, tokenizer) if t.logprobs else None for t in turns]


def _rebuild_with_provider_ids(rest: list[int], turns: Sequence[ApiTurn], assembled: list[Any], provided: list[Any],
                               bt: Any, out: list[Any], count_tolerance: float, profile: Profile) -> None:
    """Turns with provider ids: those spans' ids as given, structural tokens placed, only other text encoded."""
    todo = [s for i in rest for s, tok, span in assembled[i][0] if tok is None and span not in provided[i].ids]
    encoded = iter([e.ids for e in bt.encode_batch(todo, add_special_tokens=False)] if todo else [])
    built = []
    for i in rest:
        segs, flags, spans = assembled[i]
        given = provided[i].ids
        ids: list[int] = []
        n_r = None
        for s, tok, span in segs:
            if tok is not None:
                ids.append(tok.id)
            elif span in given:
                ids += given[span]
                if span == "reasoning":
                    n_r = len(given[span])
            else:
                part = next(encoded)
                ids += part
                if span == "reasoning":
                    n_r = len(part)
        built.append((i, ids, _join(segs)[0], n_r))
    decoded = bt.decode_batch([b[1] for b in built], skip_special_tokens=False)
    for (i, ids, text, n_r), dec in zip(built, decoded):
        segs, flags, spans = assembled[i]
        turn = turns[i]
        if turn.billed_reasoning_tokens is None or not profile.is_reasoning or "prompt_closed_reasoning" in flags:
            n_r = None
        out[i] = _verified(turn, ids, text, flags, spans, None, dec == text, n_r,
                           sorted(s for s in provided[i].ids if s in spans), count_tolerance)


_SPECIAL_CACHE: dict[tuple[int, int], tuple[Any, Any, dict[str, Any]]] = {}


def _special_texts_cached(profile: Profile, bt: Any) -> dict[str, Any]:
    """`_special_texts` once per (profile, tokenizer) object pair."""
    key = (id(profile), id(bt))
    hit = _SPECIAL_CACHE.get(key)
    if hit is None or hit[0] is not profile or hit[1] is not bt:
        if len(_SPECIAL_CACHE) > 32:
            _SPECIAL_CACHE.clear()
        hit = _SPECIAL_CACHE[key] = (profile, bt, _special_texts(profile, bt))
    return hit[2]
