"""02's rebuild: API turns encoded in one batch, verified and graded by what is proven.

`rebuild_batch` takes each turn's segments (`assemble.assemble_segments`), encodes all turns
with one batched tokenizer call (spans the provider gave per-token output for keep the
provider's ids: `provider_tokens`), and verifies each: structural tokens whole on their
seams (from the whole encoding's offsets, or by re-encoding the parts), the ids spelling the
text (`decode_batch`, or for big batches the tokenizer's byte table), the reasoning span and
a length cut right after the reasoning-close. Each result is a `proof.Rebuilt`, graded
there. The stage around it (calibration, drift, files) is `run`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Iterator, Sequence

import numpy as np

from eagle3data.core.profiles import Profile
from eagle3data.rebuild.assemble import ApiTurn, assemble_segments, special_texts_cached
from eagle3data.rebuild.proof import Rebuilt
from eagle3data.rebuild.provider_tokens import fast_backend, span_ids


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
    sp = special_texts_cached(profile, bt)
    table = _byte_table(bt) if len(turns) >= BYTE_TABLE_MIN_RECORDS else None
    with _gc_paused():
        provided = _provider_spans(turns, tokenizer, profile)
        assembled = [assemble_segments(t, profile, sp, append_guard) if p is None else
                     assemble_segments(t, profile, sp, append_guard, frozenset(p.ids), p.reasoning_closed)
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
