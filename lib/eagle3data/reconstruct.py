"""Stage 02: rebuild token ids from API text with proof, and measure how often re-tokenizing lies.

An API returns text (reasoning, content, structured tool calls), not ids. `rebuild_batch`
assembles one assistant turn per record the way the profile's model spells it
(reasoning-open if the prompt does not end with it, reasoning, reasoning-close, content,
native tool-call tokens, end-of-turn), encodes all records with one batched tokenizer call,
and verifies each: the seam check (the parts' ids concatenated equal the whole's ids), the
decode roundtrip, and the length against the API's billed `completion_tokens`. Anything odd
is flagged, never silently fixed.

Where the true ids are known (local/SGLang records), `measure_drift` splits them into what an
API would return, rebuilds, and compares: the exact-match rate tells how far to trust the
API part of a mixed dataset.

`run_reconstruct(params)` does both for a run: `reconstruct/<dataset>.jsonl` (rebuilt API
records), `reconstruct/summary.json`, `reconstruct/drift.json`. The journal is never touched.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import orjson

from .profiles import Profile, Token
from .stats import wilson_interval

# Flags a rebuilt record can carry. Informational ones describe the record; the others are
# problems for 03_audit to judge (the rebuild never repairs the text).
FLAGS: dict[str, str] = {
    "truncated": "finish_reason is length/abort: no end-of-turn appended",
    "truncated_in_reasoning": "cut inside reasoning: no reasoning-close appended either",
    "empty_reasoning": "reasoning profile but the reasoning text is empty",
    "empty_output": "no reasoning, content or tool calls at all",
    "content_has_end_of_turn": "content holds the end-of-turn (or guard) token",
    "content_has_reasoning_token": "content holds a reasoning-open/close token",
    "content_has_tool_call_token": "content holds raw tool-call tokens (kept as they are)",
    "reasoning_has_tool_call_token": "reasoning holds a tool-call token",
    "reasoning_has_reasoning_token": "reasoning holds a reasoning-open/close token",
    "reasoning_has_end_of_turn": "reasoning holds the end-of-turn (or guard) token",
    "tool_calls_without_native_form": "structured tool calls, but the profile has no tool-call tokens: not rendered",
    "bad_tool_call": "a tool call without a function name or with unusable arguments",
    "seam_mismatch": "the parts encoded separately differ from the whole",
    "roundtrip_mismatch": "decode(ids) differs from the assembled text (e.g. NFC normalization)",
    "no_billed_count": "the API billed no completion_tokens to compare with",
    "count_outside_tolerance": "rebuilt length differs from billed tokens beyond reconstruct.count_tolerance",
    "prompt_templated_here": "the record had no prompt_ids: templated from its messages",
}


@dataclass
class ApiTurn:
    """What an API returned for one prompt, plus what the rebuild needs around it."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    prompt_ids: list[int] | None = None
    billed_tokens: int | None = None


@dataclass
class Rebuilt:
    """One rebuilt assistant turn and its verification."""

    output_ids: list[int]
    text: str
    flags: list[str]
    seam_ok: bool
    seam_first_diff: int | None
    roundtrip_ok: bool
    billed_tokens: int | None
    count_diff: int | None


# ---------------------------------------------------------------- assembly (pure text)


def _special_texts(profile: Profile) -> dict[str, list[str]]:
    eot = [profile.end_of_turn.text] + ([profile.guard.text] if profile.guard else [])
    reasoning = [t.text for t in (profile.reasoning_open, profile.reasoning_close) if t is not None]
    tools = [t.text for t in profile.tool_calls.tokens()] if profile.tool_calls else []
    return {"eot": eot, "reasoning": reasoning, "tools": tools}


def _has_any(text: str, needles: list[str]) -> bool:
    """True when any needle occurs in `text` (one C substring search per needle: the fastest test here)."""
    return any(map(text.__contains__, needles))


# (field, kind of special text found in it, flag), in the order flags are reported
_TEXT_FLAGS = [
    ("content", "eot", "content_has_end_of_turn"),
    ("content", "reasoning", "content_has_reasoning_token"),
    ("content", "tools", "content_has_tool_call_token"),
    ("reasoning", "tools", "reasoning_has_tool_call_token"),
    ("reasoning", "reasoning", "reasoning_has_reasoning_token"),
    ("reasoning", "eot", "reasoning_has_end_of_turn"),
]


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


def assemble(turn: ApiTurn, profile: Profile, *, append_guard: bool = False
             ) -> tuple[list[tuple[str, Token | None]], list[str]]:
    """The turn as segments `(text, structural token or None)` in the model's order, and its flags."""
    return _assemble(turn, profile, _special_texts(profile), append_guard)


def _assemble(turn: ApiTurn, profile: Profile, sp: dict[str, list[str]], append_guard: bool
              ) -> tuple[list[tuple[str, Token | None]], list[str]]:
    """`assemble` with the profile's special texts computed once per batch."""
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
    fields = {"content": content, "reasoning": reasoning}
    flags.extend(flag for field_, kind, flag in _TEXT_FLAGS if _has_any(fields[field_], sp[kind]))

    segs: list[tuple[str, Token | None]] = []
    if profile.is_reasoning:
        if not reasoning:
            flags.append("empty_reasoning")
        ro = profile.reasoning_open
        prompt_has_open = bool(turn.prompt_ids) and ro is not None and turn.prompt_ids[-1] == ro.id
        if ro is not None and not prompt_has_open:
            segs.append((ro.text, ro))
        if reasoning:
            segs.append((reasoning, None))
        if truncated and not content and not calls:
            flags.append("truncated_in_reasoning")  # the model never closed its reasoning
        else:
            segs.append((profile.reasoning_close.text, profile.reasoning_close))  # type: ignore[union-attr]
    elif reasoning:
        segs.append((reasoning, None))  # a non-reasoning profile has no place for it: kept, flagged by audit
    if content:
        segs.append((content, None))
    if calls:
        if profile.tool_calls is None:
            flags.append("tool_calls_without_native_form")
        else:
            segs += _render_tool_calls(calls, profile, after_content=bool(content))
    if not truncated:
        segs.append((profile.end_of_turn.text, profile.end_of_turn))
        if append_guard and profile.guard is not None:
            segs.append((profile.guard.text, profile.guard))
    return _merge_text(segs), flags


def _merge_text(segs: list[tuple[str, Token | None]]) -> list[tuple[str, Token | None]]:
    """Join adjacent text segments: the model never saw a seam between them."""
    out: list[tuple[str, Token | None]] = []
    for text, tok in segs:
        if tok is None and out and out[-1][1] is None:
            out[-1] = (out[-1][0] + text, None)
        elif text:
            out.append((text, tok))
    return out


# ---------------------------------------------------------------- batched encode + verify


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the object itself)."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two id lists differ (the shorter length if one is a prefix), or None."""
    n = min(len(a), len(b))
    if n:
        x = np.asarray(a[:n]) != np.asarray(b[:n])
        if x.any():
            return int(np.argmax(x))
    return None if len(a) == len(b) else n


def _join(segs: list[tuple[str, Token | None]]) -> tuple[str, list[tuple[int, int, int]]]:
    """The assembled text and its seams: `(start, end, id)` character span of each structural token."""
    seams: list[tuple[int, int, int]] = []
    pos = 0
    for text, tok in segs:
        if tok is not None:
            seams.append((pos, pos + len(text), tok.id))
        pos += len(text)
    return "".join(s for s, _ in segs), seams


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


def rebuild_batch(turns: Sequence[ApiTurn], tokenizer: Any, profile: Profile, *, count_tolerance: float = 0.02,
                  seam_check: str = "offsets", append_guard: bool = False) -> list[Rebuilt]:
    """Rebuild and verify many turns with one batched encode.

    `seam_check="offsets"` proves the seams from the whole encoding's offsets (no second
    encode); `"reencode"` also encodes every text part on its own and compares ids. The
    roundtrip uses one `decode_batch`, or for big batches the tokenizer's byte table.
    """
    if seam_check not in ("offsets", "reencode"):
        raise ValueError(f"seam_check must be 'offsets' or 'reencode', got {seam_check!r}")
    bt = _backend(tokenizer)
    sp = _special_texts(profile)
    table = _byte_table(bt) if len(turns) >= BYTE_TABLE_MIN_RECORDS else None
    with _gc_paused():
        assembled = [_assemble(t, profile, sp, append_guard) for t in turns]
        joined = [_join(segs) for segs, _ in assembled]
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
            flat = [s for segs, _ in assembled for s, tok in segs if tok is None]
            part_ids = [e.ids for e in bt.encode_batch_fast(flat, add_special_tokens=False)] if flat else []
        out: list[Rebuilt] = []
        j = 0
        for (segs, flags), (text, seams), turn, enc, ids, dec in zip(assembled, joined, turns, encs, all_ids, decoded):
            if part_ids is not None:
                concat: list[int] = []
                for s, tok in segs:
                    if tok is None:
                        concat += part_ids[j]
                        j += 1
                    else:
                        concat.append(tok.id)
                seam_diff = _first_diff(concat, ids)
            else:
                seam_diff = _seam_diff_by_offsets(enc, ids, seams) if seams else None
            if seam_diff is not None:
                flags.append("seam_mismatch")
            roundtrip_ok = dec == text
            if not roundtrip_ok:
                flags.append("roundtrip_mismatch")
            billed = turn.billed_tokens
            diff = None
            if billed is None:
                flags.append("no_billed_count")
            else:
                diff = len(ids) - billed
                if abs(diff) > count_tolerance * max(billed, 1):
                    flags.append("count_outside_tolerance")
            out.append(Rebuilt(ids, text, flags, seam_diff is None, seam_diff, roundtrip_ok, billed, diff))
    return out


# ---------------------------------------------------------------- exact records as an API would return them


def turns_from_exact(records: Sequence[dict[str, Any]], tokenizer: Any, profile: Profile) -> list[ApiTurn]:
    """API-style turns (text only) of records with exact ids: the one split (`spans.output_texts_batch`)."""
    from .spans import output_texts_batch

    texts = output_texts_batch([r["output_ids"] for r in records], profile, tokenizer)
    return [ApiTurn(reasoning=t.reasoning, content=t.content, tool_calls=t.tool_calls,
                    finish_reason=r["finish_reason"], prompt_ids=r.get("prompt_ids"),
                    billed_tokens=(r.get("usage") or {}).get("completion_tokens"))
            for r, t in zip(records, texts)]


# ---------------------------------------------------------------- statistics


def _token_view(tokenizer: Any, ids: Sequence[int]) -> list[list[Any]]:
    bt = _backend(tokenizer)
    return [[int(i), bt.decode([int(i)], skip_special_tokens=False)] for i in ids]


@dataclass
class DriftResult:
    """Drift of one dataset's exact records: how often rebuilding from text gives the true ids."""

    dataset: str
    n: int
    exact: int
    text_equal: int
    rate: float
    ci95: tuple[float, float]
    first_divergence: list[int] = field(default_factory=list)
    examples: list[dict[str, Any]] = field(default_factory=list)


def measure_drift(records: Sequence[dict[str, Any]], tokenizer: Any, profile: Profile, *, dataset: str = "",
                  examples: int = 3, window: int = 4, seam_check: str = "offsets") -> DriftResult:
    """Decode exact records, split as an API would, rebuild, and compare with the true ids."""
    recs = [r for r in records if r.get("output_ids") is not None and r.get("finish_reason") != "error"]
    turns = turns_from_exact(recs, tokenizer, profile)
    rebuilt = rebuild_batch(turns, tokenizer, profile, seam_check=seam_check, count_tolerance=float("inf"))
    truth_texts = _backend(tokenizer).decode_batch([list(r["output_ids"]) for r in recs], skip_special_tokens=False)
    exact = text_equal = 0
    divs: list[int] = []
    ex: list[dict[str, Any]] = []
    for r, rb, tt in zip(recs, rebuilt, truth_texts):
        true_ids = list(r["output_ids"])
        text_equal += int(tt == rb.text)
        d = _first_diff(true_ids, rb.output_ids)
        if d is None:
            exact += 1
            continue
        divs.append(d)
        if len(ex) < examples:
            lo = max(0, d - window)
            ex.append({"sample_id": r["sample_id"], "position": d, "true_len": len(true_ids),
                       "rebuilt_len": len(rb.output_ids), "text_equal": tt == rb.text,
                       "true": _token_view(tokenizer, true_ids[lo : d + window]),
                       "rebuilt": _token_view(tokenizer, rb.output_ids[lo : d + window]), "window_start": lo})
    n = len(recs)
    return DriftResult(dataset, n, exact, text_equal, exact / n if n else float("nan"), wilson_interval(exact, n),
                       divs, ex)


# ---------------------------------------------------------------- the stage


def _prompt_ids_for(recs: list[dict[str, Any]], tokenizer: Any, profile: Profile) -> list[list[int] | None]:
    """Prompt ids of API records; missing ones are templated (rendered per record, encoded in one batch)."""
    from .prompts import Prompt, messages_for_template

    need = [i for i, r in enumerate(recs) if r.get("prompt_ids") is None and r.get("messages")]
    out: list[list[int] | None] = [r.get("prompt_ids") for r in recs]
    if need:
        texts = []
        for i in need:
            r = recs[i]
            msgs, tools = messages_for_template(Prompt(r["dataset"], r["sample_id"], r["messages"], r.get("tools")),
                                                profile)
            kw = dict(profile.template_kwargs) | ({"tools": tools} if tools else {})
            texts.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw))
        for i, e in zip(need, _backend(tokenizer).encode_batch_fast(texts, add_special_tokens=False)):
            out[i] = e.ids
    return out


def reconstruct_records(recs: list[dict[str, Any]], tokenizer: Any, profile: Profile, rp: Any) -> list[dict[str, Any]]:
    """Output lines of `reconstruct/<dataset>.jsonl` for API records (errors skipped)."""
    recs = [r for r in recs if r.get("finish_reason") != "error"]
    out: list[dict[str, Any]] = []
    for lo in range(0, len(recs), rp.batch_size):
        chunk = recs[lo : lo + rp.batch_size]
        prompts = _prompt_ids_for(chunk, tokenizer, profile)
        turns = [ApiTurn(r.get("reasoning"), r.get("content"), r.get("tool_calls"), r["finish_reason"], p,
                         (r.get("usage") or {}).get("completion_tokens")) for r, p in zip(chunk, prompts)]
        rebuilt = rebuild_batch(turns, tokenizer, profile, count_tolerance=rp.count_tolerance,
                                seam_check=rp.seam_check, append_guard=rp.append_guard)
        for r, p, rb in zip(chunk, prompts, rebuilt):
            p = list(p or [])
            flags = rb.flags + (["prompt_templated_here"] if r.get("prompt_ids") is None and p else [])
            out.append({
                "dataset": r["dataset"], "sample_id": r["sample_id"], "source": r.get("source"),
                "provider": r.get("provider"), "ids_exact": False, "prompt_ids": p, "output_ids": rb.output_ids,
                "input_ids": p + rb.output_ids, "loss_mask": [0] * len(p) + [1] * len(rb.output_ids),
                "flags": flags, "seam_ok": rb.seam_ok, "seam_first_diff": rb.seam_first_diff,
                "roundtrip_ok": rb.roundtrip_ok, "billed_tokens": rb.billed_tokens,
                "rebuilt_tokens": len(rb.output_ids), "count_diff": rb.count_diff,
                "finish_reason": r["finish_reason"],
            })
    return out


def summarize(lines: Iterable[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """Per-`key` (dataset or provider) counts: records, flags, seam/roundtrip failures, count agreement."""
    acc: dict[str, dict[str, Any]] = {}
    for ln in lines:
        k = str(ln.get(key) or "unknown")
        a = acc.setdefault(k, {"records": 0, "seam_failures": 0, "roundtrip_failures": 0, "billed_tokens": 0,
                               "rebuilt_tokens_billed": 0, "abs_count_diff": 0, "count_outside_tolerance": 0,
                               "flags": {}})
        a["records"] += 1
        a["seam_failures"] += int(not ln["seam_ok"])
        a["roundtrip_failures"] += int(not ln["roundtrip_ok"])
        if ln["billed_tokens"] is not None:
            a["billed_tokens"] += ln["billed_tokens"]
            a["rebuilt_tokens_billed"] += ln["rebuilt_tokens"]
            a["abs_count_diff"] += abs(ln["count_diff"])
        for f in ln["flags"]:
            a["flags"][f] = a["flags"].get(f, 0) + 1
        a["count_outside_tolerance"] = a["flags"].get("count_outside_tolerance", 0)
    for a in acc.values():
        b = a["billed_tokens"]
        a["count_diff_pct"] = 100.0 * (a["rebuilt_tokens_billed"] - b) / b if b else None
        a["abs_count_diff_pct"] = 100.0 * a["abs_count_diff"] / b if b else None
    return acc


@dataclass
class ReconstructResult:
    """What 02_reconstruct found: rebuilt API records and drift on exact records, as tables."""

    run_dir: Path
    summary: dict[str, Any]
    drift: dict[str, Any]
    seconds: float

    def table(self):
        """Per-dataset rebuild summary of API records (empty when the run has none)."""
        import pandas as pd

        rows = [{"dataset": k, **{c: v for c, v in a.items() if c != "flags"}}
                for k, a in self.summary["datasets"].items()]
        cols = ["dataset", "records", "seam_failures", "roundtrip_failures", "billed_tokens", "count_diff_pct",
                "abs_count_diff_pct", "count_outside_tolerance"]
        return pd.DataFrame(rows, columns=cols).set_index("dataset")

    def provider_table(self):
        """Per-provider count agreement of API records."""
        import pandas as pd

        rows = [{"provider": k, **{c: v for c, v in a.items() if c != "flags"}}
                for k, a in self.summary["providers"].items()]
        cols = ["provider", "records", "billed_tokens", "count_diff_pct", "abs_count_diff_pct",
                "count_outside_tolerance"]
        return pd.DataFrame(rows, columns=cols).set_index("provider")

    def flag_table(self):
        """Records per flag and dataset (API records)."""
        import pandas as pd

        data = {k: a["flags"] for k, a in self.summary["datasets"].items()}
        return pd.DataFrame(data).fillna(0).astype(int).T if data else pd.DataFrame()

    def drift_table(self):
        """Per dataset: exact-match rate of rebuilt vs true ids with its 95% Wilson interval."""
        import pandas as pd

        rows = []
        for k, d in self.drift["datasets"].items():
            fd = d["first_divergence"]
            rows.append({"dataset": k, "records": d["n"], "exact": d["exact"], "exact_rate": d["rate"],
                         "ci95_low": d["ci95"][0], "ci95_high": d["ci95"][1], "text_equal": d["text_equal"],
                         "first_divergence_median": float(np.median(fd)) if fd else None,
                         "first_divergence_min": min(fd) if fd else None})
        cols = ["dataset", "records", "exact", "exact_rate", "ci95_low", "ci95_high", "text_equal",
                "first_divergence_median", "first_divergence_min"]
        return pd.DataFrame(rows, columns=cols).set_index("dataset")

    def drift_examples(self):
        """Divergent examples token by token: one row per position of each example's window."""
        import pandas as pd

        rows = []
        for k, d in self.drift["datasets"].items():
            for ex in d["examples"]:
                n = max(len(ex["true"]), len(ex["rebuilt"]))
                for i in range(n):
                    t = ex["true"][i] if i < len(ex["true"]) else [None, ""]
                    r = ex["rebuilt"][i] if i < len(ex["rebuilt"]) else [None, ""]
                    pos = ex["window_start"] + i
                    rows.append({"dataset": k, "sample_id": ex["sample_id"], "pos": pos,
                                 "true_id": t[0], "true_text": repr(t[1]), "rebuilt_id": r[0],
                                 "rebuilt_text": repr(r[1]), "diverges": pos >= ex["position"] and t[0] != r[0]})
        return pd.DataFrame(rows)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def run_reconstruct(params: Any, progress: bool = True, tokenizer: Any = None) -> ReconstructResult:
    """Stage 02 on a run: rebuild API records beside the journal, measure drift on exact records."""
    from tqdm.auto import tqdm

    from .models import tokenizer_for
    from .profiles import get_profile
    from .provenance import write_provenance
    from .reader import read_run

    t0 = time.perf_counter()
    rp = params.reconstruct
    profile = get_profile(params.profile)
    tokenizer = tokenizer or tokenizer_for(params)
    run_dir = params.run_dir
    out_dir = run_dir / "reconstruct"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_provenance(run_dir, "02_reconstruct", params)
    all_lines: list[dict[str, Any]] = []
    drift: dict[str, Any] = {"datasets": {}}
    skipped: dict[str, int] = {}
    view = read_run(run_dir, [d.name for d in params.datasets], rebuilt=False, verdicts=False)
    for d in tqdm(params.datasets, desc="reconstruct", unit="dataset", disable=not progress):
        recs = view.datasets[d.name].records()  # the record of each sample (a retried error is superseded)
        api = [r for r in recs if r.get("source") == "api" and r.get("output_ids") is None]
        exact = [r for r in recs if r.get("ids_exact") and r.get("output_ids") is not None]
        skipped[d.name] = sum(1 for r in api if r.get("finish_reason") == "error")
        lines = reconstruct_records(api, tokenizer, profile, rp) if api else []
        target = out_dir / f"{d.name}.jsonl"
        if lines:
            _write_atomic(target, b"".join(orjson.dumps(ln) + b"\n" for ln in lines))
        elif target.exists():
            target.unlink()  # a stale file from an earlier run would be read as this run's
        all_lines += lines
        if rp.drift and exact:
            dr = measure_drift(exact, tokenizer, profile, dataset=d.name, examples=rp.drift_examples,
                               seam_check=rp.seam_check)
            drift["datasets"][d.name] = dr.__dict__ | {"ci95": list(dr.ci95)}
    tot_n = sum(v["n"] for v in drift["datasets"].values())
    tot_k = sum(v["exact"] for v in drift["datasets"].values())
    drift["overall"] = {"n": tot_n, "exact": tot_k, "rate": tot_k / tot_n if tot_n else None,
                        "ci95": list(wilson_interval(tot_k, tot_n))}
    summary = {"profile": profile.name, "api_records": len(all_lines), "errors_skipped": skipped,
               "datasets": summarize(all_lines, "dataset"), "providers": summarize(all_lines, "provider"),
               "overall": summarize(({**ln, "all": "all"} for ln in all_lines), "all").get("all"),
               "flags_meaning": FLAGS, "params": rp.model_dump(mode="json")}
    _write_atomic(out_dir / "summary.json", orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    _write_atomic(out_dir / "drift.json", orjson.dumps(drift, option=orjson.OPT_INDENT_2))
    return ReconstructResult(run_dir, summary, drift, time.perf_counter() - t0)


# ---------------------------------------------------------------- synthetic API records (tests, bench)


def synthetic_api_record(dataset: str, sample_id: int | str, *, reasoning: str | None, content: str | None,
                         tool_calls: list[dict[str, Any]] | None = None, finish_reason: str = "stop",
                         completion_tokens: int | None = None, provider: str | None = "synthetic",
                         profile: str = "qwen3", prompt_ids: list[int] | None = None,
                         messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A journal record as the `openai` backend writes it: text fields and usage, no output ids."""
    return {
        "dataset": dataset, "sample_id": sample_id, "source": "api", "model": "synthetic", "profile": profile,
        "messages": messages or [{"role": "user", "content": f"question {sample_id}"}], "prompt_ids": prompt_ids,
        "output_ids": None, "ids_exact": False, "reasoning": reasoning, "content": content,
        "tool_calls": tool_calls, "finish_reason": finish_reason,
        "usage": {"completion_tokens": completion_tokens}, "provider": provider,
    }


def tool_call(name: str, arguments: dict[str, Any] | str, call_id: str | None = None) -> dict[str, Any]:
    """An OpenAI-format tool call (arguments as JSON text, the way APIs return them)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or f"call_{name}", "type": "function", "function": {"name": name, "arguments": args}}
