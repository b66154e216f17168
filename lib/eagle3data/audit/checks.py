"""03's checks: each a stable name and what it asserts; vectorized id checks over an `IdTable`.

The id checks find every special token of the profile in one pass over the flat output
array and reason on their positions, so there is no Python loop per record; only the
tokenizer checks (`textchecks`: re-templating, decode->encode roundtrip, text fields against the
one split of the ids) loop. The checks across records (a key completed twice, an output another
prompt's record has too, a turn's history against its conversation's replies) decide on small
per-record facts (`record_hashes`, `on_policy_facts`), so a run read in chunks lets each chunk's
ids go. Statuses per record and check: pass, fail, n/a (the check does not apply
to this record or profile), not run (the check needs a tokenizer that was not given) and flagged
(a check named in `audit.flag_only` did not hold: counted and shown, the record is kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import orjson
import pandas as pd
import xxhash

from eagle3data.audit.idtable import IdTable
from eagle3data.core.profiles import Profile
from eagle3data.core.params import ReconstructParams
from eagle3data.core.reader import COMPLETED, SampleKey, supersede_codes
from eagle3data.core.stats import calibrated_offset
from eagle3data.generate.turns import assistant_message

PASS, FAIL, NA, NOT_RUN, FLAG = 0, 1, 2, 3, 4
STATUS_NAMES = {PASS: "pass", FAIL: "fail", NA: "n/a", NOT_RUN: "not run", FLAG: "flagged"}


@dataclass(frozen=True)
class Check:
    """One audit check: a stable name, what it asserts, and when it applies."""

    name: str
    what: str
    applies: Callable[[Profile], bool] = lambda p: True
    needs_tokenizer: bool = False


def _reasoning(p: Profile) -> bool:
    return p.is_reasoning


def _tools(p: Profile) -> bool:
    return p.tool_calls is not None


def _reasoning_tools(p: Profile) -> bool:
    return p.is_reasoning and p.tool_calls is not None


_CHECK_LIST = [
    Check("record.complete", "finish_reason is stop or length (not error/abort)"),
    Check("record.has_ids", "prompt and output ids exist (journal, or 02_reconstruct for API records)"),
    Check("output.ends_with_eot", "output ends with end-of-turn (the guard token may follow it)"),
    Check("output.single_eot", "exactly one end-of-turn in the output (none when truncated)"),
    Check("output.single_reasoning_close", "exactly one reasoning-close (at most one when truncated)", _reasoning),
    Check("output.close_before_eot", "reasoning-close comes before end-of-turn", _reasoning),
    Check("output.no_reasoning_open", "no reasoning-open inside the output", _reasoning),
    Check("output.reasoning_nonempty", "at least one reasoning token before reasoning-close", _reasoning),
    Check("output.answer_nonempty", "at least one token between reasoning-close (or start) and end-of-turn"),
    Check("output.tool_calls_balanced", "tool-call tokens balanced, in order, before end-of-turn", _tools),
    Check("output.tool_calls_outside_reasoning", "no tool-call token before reasoning-close", _reasoning_tools),
    Check("output.ids_in_vocab", "every output id is in [0, vocab_size)"),
    Check("prompt.ids_in_vocab", "every prompt id is in [0, vocab_size)"),
    Check("prompt.generation_prompt", "prompt ends with the generation prompt the profile expects"),
    Check("prompt.tools_present", "every tool of the source is named in the decoded prompt", needs_tokenizer=True),
    Check("prompt.system_present", "the source's system prompt is in the decoded prompt", needs_tokenizer=True),
    Check("prompt.retemplate", "prompt ids equal re-templating the source messages", needs_tokenizer=True),
    Check("prompt.billed_count", "an API record's billed prompt tokens equal its prompt ids' length, after the offset "
          "calibrated per (provider, dataset) as 02's counts are: the server rendered the prompt we templated"),
    Check("prompt.on_policy", "a turn's history holds the model's own journaled replies of its earlier turns, in order "
          "(generate.turns: all), not the dataset's"),
    Check("text.roundtrip", "encode(decode(output ids)) gives the same ids (by default a flag, audit.flag_only: "
          "ids that re-encoding the text would not give back are kept, they are what exact ids exist for)",
          needs_tokenizer=True),
    Check("text.fields_match", "decoded reasoning/answer spans equal the record's reasoning/content",
          needs_tokenizer=True),
    Check("dataset.unique_sample_id",
          "no other completed line of the dataset has this sample_id (a retried error is superseded, not a duplicate)"),
    Check("dataset.distinct_outputs", "no record with a different prompt has identical output ids"),
]
CHECKS: dict[str, Check] = {c.name: c for c in _CHECK_LIST}
CHECK_NAMES: list[str] = [c.name for c in _CHECK_LIST]



# --------------------------------------------------------------------------- vectorized id checks


_CHUNK = 1 << 18  # elements per step of the scans: the temporaries stay in the CPU cache


def _unsigned(ids: np.ndarray) -> tuple[np.ndarray, type]:
    """ids as int32/int64 and the unsigned type of the same width (a negative id reads as a huge one)."""
    if ids.dtype not in (np.int32, np.int64):
        ids = ids.astype(np.int64)
    return ids, (np.uint32 if ids.dtype == np.int32 else np.uint64)


def _band_scan(ids: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int]:
    """One pass over ids: positions of ids in [lo, hi], and the largest id read as unsigned (for the vocab
    check: every id is in [0, vocab) exactly when that is below vocab).

    `(id - lo)` read as unsigned is at most `hi - lo` exactly for ids in the band (the
    subtraction wraps the rest out of it), so the band costs one subtraction and one compare.
    """
    if len(ids) == 0:
        return np.zeros(0, np.int64), 0
    ids, udt = _unsigned(ids)
    if not (np.iinfo(ids.dtype).min <= lo <= hi <= np.iinfo(ids.dtype).max):
        ids, udt = ids.astype(np.int64), np.uint64
    n = min(_CHUNK, len(ids))
    diff, mask = np.empty(n, ids.dtype), np.empty(n, bool)
    hits, top = [], 0
    for s in range(0, len(ids), _CHUNK):
        a = ids[s : s + _CHUNK]
        d, m = diff[: len(a)], mask[: len(a)]
        np.subtract(a, ids.dtype.type(lo), out=d, casting="unsafe")
        np.less_equal(d.view(udt), udt(hi - lo), out=m)
        h = np.flatnonzero(m)
        if len(h):
            hits.append(h + s)
        top = max(top, int(a.view(udt).max()))
    return (np.concatenate(hits) if hits else np.zeros(0, np.int64)), top


def _events(ids: np.ndarray, off: np.ndarray, codes: dict[int, int]
            ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int]:
    """special_events plus the largest id read as unsigned, from the same pass."""
    if not codes or len(ids) == 0:
        e = np.zeros(0, np.int64)
        return (e, e.copy(), e.copy()), _unsigned_max(ids)
    lo, hi = min(codes), max(codes)
    lut = np.zeros(hi - lo + 1, np.int16)
    for tid, c in codes.items():
        lut[tid - lo] = c
    pos, top = _band_scan(ids, lo, hi)
    code = lut[ids[pos] - lo].astype(np.int64)
    keep = code > 0
    pos, code = pos[keep], code[keep]
    rec = np.searchsorted(off, pos, side="right") - 1
    return (rec, pos - off[rec], code), top


def _unsigned_max(ids: np.ndarray) -> int:
    if len(ids) == 0:
        return 0
    ids, udt = _unsigned(ids)
    return int(ids.view(udt).max())


def special_events(ids: np.ndarray, off: np.ndarray, codes: dict[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All occurrences of the given ids in one pass: (record index, position in record, code).

    The flat array is scanned in cache-sized chunks for ids inside the [min, max] band of
    the special ids, then a small lookup table maps each hit to its code (0 = not special).
    """
    return _events(ids, off, codes)[0]


def _out_of_range(ids: np.ndarray, off: np.ndarray, vocab: int, top: int | None = None) -> np.ndarray:
    """Per record: any id outside [0, vocab). The largest id read as unsigned first (`top`, from the
    scan when given); the slow path only on a hit."""
    n = len(off) - 1
    bad = np.zeros(n, bool)
    if len(ids) == 0 or (top if top is not None else _unsigned_max(ids)) < vocab:
        return bad
    pos = np.flatnonzero((ids < 0) | (ids >= vocab))
    bad[np.unique(np.searchsorted(off, pos, side="right") - 1)] = True
    return bad


@dataclass
class Positions:
    """Per record: where the profile's special tokens sit in the output (-1 = absent)."""

    first_close: np.ndarray
    first_eot: np.ndarray
    n_close: np.ndarray
    n_eot: np.ndarray
    n_open: np.ndarray
    reasoning_start: np.ndarray
    tool_sections: pd.DataFrame  # record, begin, end (positions in the output)
    events: pd.DataFrame  # record, pos, token


def structural_checks(table: IdTable, profile: Profile) -> tuple[dict[str, np.ndarray], Positions]:
    """The id checks on every record at once; returns status arrays per check and positions."""
    n = len(table)
    L = table.output_len
    fr = table.meta["finish_reason"]
    trunc = (fr == "length").to_numpy(dtype=bool)
    usable = table.has_output & ((fr == "stop").to_numpy(dtype=bool) | trunc)
    ids, off = table.output, table.output_off

    names: list[tuple[str, int]] = [("eot", profile.end_of_turn.id)]
    for nm in ("guard", "reasoning_open", "reasoning_close"):
        tok = getattr(profile, nm)
        if tok is not None:
            names.append((nm, tok.id))
    tc = profile.tool_calls
    tool_names: list[str] = []
    if tc is not None:
        for nm in ("section_begin", "call_begin", "argument_begin", "call_end", "section_end"):
            tok = getattr(tc, nm)
            if tok is not None:
                names.append((nm, tok.id))
                tool_names.append(nm)
    code_of = {nm: i + 1 for i, (nm, _) in enumerate(names)}
    K = len(names) + 1
    (rec, rel, code), ids_top = _events(ids, off, {tid: code_of[nm] for nm, tid in names})

    counts = np.bincount(rec * K + code, minlength=n * K).reshape(n, K) if n else np.zeros((0, K), np.int64)
    first = np.full((n, K), -1, np.int64)
    if len(rec):
        big = np.full((n, K), np.iinfo(np.int64).max, np.int64)
        np.minimum.at(big, (rec, code), rel)
        first = np.where(big == np.iinfo(np.int64).max, -1, big)

    def cnt(nm: str) -> np.ndarray:
        return counts[:, code_of[nm]] if nm in code_of else np.zeros(n, np.int64)

    def fst(nm: str) -> np.ndarray:
        return first[:, code_of[nm]] if nm in code_of else np.full(n, -1, np.int64)

    st: dict[str, np.ndarray] = {}

    def status(fail: np.ndarray, na: np.ndarray | None = None) -> np.ndarray:
        s = np.where(fail, FAIL, PASS).astype(np.int8)
        s[~usable] = NA
        if na is not None:
            s[na] = NA
        return s

    eot = profile.end_of_turn.id
    nonempty = L > 0
    last = np.where(nonempty, ids[np.maximum(off[1:] - 1, 0)] if len(ids) else -1, -1)
    prev = np.where(L > 1, ids[np.maximum(off[1:] - 2, 0)] if len(ids) else -1, -1)
    ends = last == eot
    if profile.guard is not None:
        ends |= (last == profile.guard.id) & (prev == eot)
    st["output.ends_with_eot"] = status(~ends, trunc)
    n_eot, f_eot = cnt("eot"), fst("eot")
    st["output.single_eot"] = status(np.where(trunc, n_eot != 0, n_eot != 1))

    n_close, f_close = cnt("reasoning_close"), fst("reasoning_close")
    n_open, f_open = cnt("reasoning_open"), fst("reasoning_open")
    has_close = n_close > 0
    if profile.prompt_ends_with_reasoning_open:
        rstart = np.zeros(n, np.int64)
        open_bad = n_open > 0
    else:  # qwen3 style: the output may start with <think>
        at0 = (n_open >= 1) & (f_open == 0)
        rstart = np.where(at0, 1, 0)
        open_bad = (n_open > 1) | ((n_open == 1) & ~at0)
    if profile.is_reasoning:
        st["output.single_reasoning_close"] = status(np.where(trunc, n_close > 1, n_close != 1))
        # a close at or after the first end-of-turn, or any close with no end-of-turn before it
        last_close = np.full(n, -1, np.int64)
        if len(rec):
            cl = code == code_of["reasoning_close"]
            np.maximum.at(last_close, rec[cl], rel[cl])
        st["output.close_before_eot"] = status(has_close & (n_eot > 0) & (last_close > f_eot))
        st["output.no_reasoning_open"] = status(open_bad)
        st["output.reasoning_nonempty"] = status(
            np.where(has_close, f_close <= rstart, ~(L > rstart)), ~has_close & ~trunc)
        astart = np.where(has_close, f_close + 1, 0)
        answer_na = trunc | ~has_close
    else:
        astart = np.zeros(n, np.int64)
        answer_na = trunc
    aend = np.where(n_eot > 0, f_eot, L)
    st["output.answer_nonempty"] = status(aend <= astart, answer_na)

    sections = pd.DataFrame({"record": [], "begin": [], "end": []}, dtype=np.int64)
    if tc is not None:
        tcodes = np.array([code_of[nm] for nm in tool_names])
        is_tool = np.isin(code, tcodes)
        trec, trel, tcode = rec[is_tool], rel[is_tool], code[is_tool]
        allowed, allowed_end = _tool_grammar(tc, code_of, K)
        prev_code = np.zeros(len(tcode), np.int64)  # 0 = start of the record
        if len(tcode):
            same = np.r_[False, trec[1:] == trec[:-1]]
            prev_code[same] = tcode[:-1][same[1:]]
        bad_step = ~allowed[prev_code, tcode]
        after_eot = (n_eot[trec] > 0) & (trel > f_eot[trec])
        bad = np.zeros(n, bool)
        bad[trec[bad_step | after_eot]] = True
        if len(tcode):
            is_last = np.r_[trec[1:] != trec[:-1], True]
            end_bad = ~allowed_end[tcode[is_last]] & ~trunc[trec[is_last]]
            bad[trec[is_last][end_bad]] = True
        st["output.tool_calls_balanced"] = status(bad)
        if profile.is_reasoning:
            inside = np.zeros(n, bool)
            ins = has_close[trec] & (trel < f_close[trec])
            inside[trec[ins]] = True
            st["output.tool_calls_outside_reasoning"] = status(inside, ~has_close)
        b_nm = "section_begin" if tc.section_begin is not None else "call_begin"
        e_nm = "section_end" if tc.section_end is not None else "call_end"
        bm, em = tcode == code_of[b_nm], tcode == code_of[e_nm]
        if bm.sum() == em.sum() and bm.any():
            sections = pd.DataFrame({"record": trec[bm], "begin": trel[bm], "end": trel[em]})
        elif bm.any():
            sections = pd.DataFrame({"record": trec[bm], "begin": trel[bm], "end": trel[bm]})

    oov = _out_of_range(ids, off, profile.vocab_size, ids_top)
    st["output.ids_in_vocab"] = status(oov)
    poov = _out_of_range(table.prompt, table.prompt_off, profile.vocab_size)
    s = np.where(poov, FAIL, PASS).astype(np.int8)
    s[~table.has_prompt] = NA
    st["prompt.ids_in_vocab"] = s

    events = pd.DataFrame({"record": rec, "pos": rel,
                           "token": pd.Categorical.from_codes(code - 1, categories=[nm for nm, _ in names])})
    pos = Positions(f_close, f_eot, n_close, n_eot, n_open, rstart, sections, events)
    return st, pos


def _tool_grammar(tc: Any, code_of: dict[str, int], K: int) -> tuple[np.ndarray, np.ndarray]:
    """Allowed (previous tool token -> tool token) steps, and the tokens a record may end on."""
    allowed = np.zeros((K, K), bool)
    allowed_end = np.zeros(K, bool)
    c = code_of
    call_tail = "argument_begin" if tc.argument_begin is not None else None
    if tc.section_begin is not None:
        allowed[0, c["section_begin"]] = True
        allowed[c["section_end"], c["section_begin"]] = True
        allowed[c["section_begin"], c["call_begin"]] = True
        allowed[c["call_end"], c["section_end"]] = True
        allowed_end[c["section_end"]] = True
    else:
        allowed[0, c["call_begin"]] = True
        allowed_end[c["call_end"]] = True
    allowed[c["call_end"], c["call_begin"]] = True
    if call_tail:
        allowed[c["call_begin"], c[call_tail]] = True
        allowed[c[call_tail], c["call_end"]] = True
    else:
        allowed[c["call_begin"], c["call_end"]] = True
    return allowed, allowed_end


def generation_suffix(tokenizer: Any, profile: Profile) -> list[int]:
    """Ids the chat template appends as the generation prompt (with the profile's options)."""
    msgs = [{"role": "user", "content": "x"}]
    kw = dict(profile.template_kwargs)

    def ids(gen: bool) -> list[int]:
        r = tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=False, **kw)
        return list(r["input_ids"] if isinstance(r, dict) else r)

    a, b = ids(False), ids(True)
    if b[: len(a)] != a:
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return b[k:]
    return b[len(a):]


def suffix_check(table: IdTable, suffix: Sequence[int]) -> np.ndarray:
    """Per record: the prompt ends with `suffix` (vectorized gather of the last k ids)."""
    k = len(suffix)
    Lp = table.prompt_len
    if k == 0 or len(table.prompt) == 0:
        return np.where(table.has_prompt, PASS if k == 0 else FAIL, NA).astype(np.int8)
    idx = table.prompt_off[1:, None] - k + np.arange(k)[None, :]
    idx = np.clip(idx, 0, len(table.prompt) - 1)
    ok = (Lp >= k) & (table.prompt[idx] == np.asarray(suffix)[None, :]).all(axis=1)
    s = np.where(ok, PASS, FAIL).astype(np.int8)
    s[~table.has_prompt] = NA
    return s


def _hashes(flat: np.ndarray, off: np.ndarray, rows: list[int], seed: int) -> list[bytes]:
    """XXH3-128 of each row's ids (their bytes as stored: one table's, or one reader's, are of one width)."""
    mv = memoryview(np.ascontiguousarray(flat)).cast("B")
    w, o = flat.itemsize, off.tolist()
    return [xxhash.xxh3_128_digest(mv[o[i] * w : o[i + 1] * w], seed) for i in rows]


def record_hashes(table: IdTable, rows: np.ndarray | None = None, only: np.ndarray | None = None) -> np.ndarray:
    """Per record: a 128-bit hash of its output ids and one of its prompt, as (n, 4) uint64.

    Columns 0-1: XXH3-128 of the output ids (zeros without output); 2-3: of the prompt ids, else (another seed)
    of the record's messages as JSON, else of its row (`rows`: the rows' numbers in the whole run), so two
    records without prompt ids or messages never share a prompt. What `dataset.distinct_outputs` needs of every
    record, 32 bytes whatever its length: the ids themselves can be let go. `only`: hash these rows (others 0)."""
    n = len(table)
    rows = np.arange(n) if rows is None else rows
    idx = np.arange(n) if only is None else np.asarray(only, np.int64)
    k = len(idx)
    out, prompt = [bytes(16)] * k, [bytes(16)] * k
    at = np.flatnonzero(table.has_output[idx])
    for j, v in zip(at.tolist(), _hashes(table.output, table.output_off, idx[at].tolist(), 0)):
        out[j] = v
    at = np.flatnonzero(table.has_prompt[idx])
    for j, v in zip(at.tolist(), _hashes(table.prompt, table.prompt_off, idx[at].tolist(), 1)):
        prompt[j] = v
    for j in np.flatnonzero(~table.has_prompt[idx]).tolist():
        i = int(idx[j])
        prompt[j] = (xxhash.xxh3_128_digest(orjson.dumps(table.messages[i]), 2) if table.messages
                     else xxhash.xxh3_128_digest(b"%d" % int(rows[i]), 3))
    got = np.frombuffer(b"".join(chain.from_iterable(zip(out, prompt))), np.uint64).reshape(k, 4)
    if only is None:
        return got.copy()
    res = np.zeros((n, 4), np.uint64)
    res[idx] = got
    return res


def cross_record_checks(table: Any, hashes: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Two completed records for one key (the supersede rule, `reader.supersede_codes`); identical outputs for different prompts.

    `table` holds one row per key (`runtable.supersede_lines`); its meta column `duplicate`
    marks the records of keys with another completed line. A table read without the rule
    (every journal line) gets it applied here, on the lines as they are. Outputs are compared by
    `record_hashes`: given for a table whose ids were let go; else computed from its ids for the records
    that share a cheap signature. Records whose outputs hash alike, and whose prompts do not all hash
    alike, fail.
    """
    n = len(table)
    meta = table.meta
    if "duplicate" in meta:
        dup = meta["duplicate"].to_numpy(dtype=bool)
    else:
        done = meta["finish_reason"].isin(COMPLETED).to_numpy(dtype=bool)
        is_record, d = supersede_codes(SampleKey.codes_of_frame(meta), done)
        dup = d | (~is_record & done)
    st = {"dataset.unique_sample_id": np.where(dup, FAIL, PASS).astype(np.int8)}
    distinct = np.zeros(n, np.int8)
    usable = table.has_output & (table.output_len > 0)
    distinct[~usable] = NA
    if usable.sum() > 1:
        rows = np.flatnonzero(usable)
        if hashes is None:  # the ids are here: only records that share a signature (length, 9 spread ids) are hashed
            ids, off, L = table.output, table.output_off, table.output_len
            start, span = off[:-1][rows], L[rows] - 1
            with np.errstate(over="ignore"):  # equal rows sign alike; a collision only adds a candidate
                sig = L[rows].astype(np.uint64)
                for k in range(9):
                    sig = sig * np.uint64(0x9E3779B97F4A7C15) + ids[start + span * k // 8].astype(np.uint64)
            rows = rows[pd.Series(sig).duplicated(keep=False).to_numpy()]
            hashes = record_hashes(table, only=rows)
        g = pd.DataFrame(hashes[rows], columns=["o1", "o2", "p1", "p2"]).assign(rec=rows)
        g = g[g.duplicated(["o1", "o2"], keep=False)]  # outputs another record has too
        if len(g):
            prompts = g.drop_duplicates(["o1", "o2", "p1", "p2"]).groupby(["o1", "o2"]).size()
            shared = prompts[prompts > 1].index
            bad = pd.MultiIndex.from_frame(g[["o1", "o2"]]).isin(shared)
            distinct[g["rec"].to_numpy()[bad]] = FAIL
    st["dataset.distinct_outputs"] = distinct
    return st


# --------------------------------------------------------------------------- cross-record facts (tokenizer checks: textchecks.py)


def _reply_view(msg: dict[str, Any]) -> tuple[Any, ...]:
    """What a history's assistant message says: answer, reasoning, and each tool call (name, arguments)."""
    calls = tuple((str((c.get("function") or {}).get("name")), str((c.get("function") or {}).get("arguments")))
                  for c in msg.get("tool_calls") or [] if isinstance(c, dict))
    return msg.get("content") or "", msg.get("reasoning_content"), calls


def billed_prompt_checks(table: IdTable, calibration: dict[str, Any] | None = None
                         ) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """`prompt.billed_count` per record, and the calibration table (one row per (provider, dataset)).

    For API records (`source: api`) with billed `usage.prompt_tokens` and prompt ids: the billed
    count minus the prompt's length must be the group's offset, learned as 02 learns completion
    offsets (`stats.calibrated_offset`: the most common difference when enough records agree and it
    is small, else 0). A record off it was billed for a prompt other than the one we templated (a
    provider that injects a system prompt, renders tools or the history differently, drops reasoning
    we kept): its prompt ids are not what the model saw. n/a for engine records and records without a
    billed count.
    """
    cal = dict(ReconstructParams().count_calibration, **(calibration or {}))  # run_audit passes the run's own
    n = len(table)
    st = np.full(n, NA, np.int8)
    m = table.meta
    if n == 0 or "billed_prompt_tokens" not in m:
        return {"prompt.billed_count": st}, []
    billed = pd.to_numeric(m["billed_prompt_tokens"], errors="coerce").to_numpy(dtype=float)
    api = (m["source"].to_numpy(dtype=object) == "api") & table.has_prompt & ~np.isnan(billed)
    rows = np.flatnonzero(api)
    diff = np.zeros(n, np.int64)
    diff[rows] = billed[rows].astype(np.int64) - table.prompt_len[rows]
    groups = pd.DataFrame({"provider": m["provider"].iloc[rows].fillna("?").astype(str).to_numpy(),
                           "dataset": m["dataset"].iloc[rows].astype(str).to_numpy(), "row": rows})
    out = []
    for (provider, dataset), g in groups.groupby(["provider", "dataset"], sort=True):
        r = g["row"].to_numpy()
        offset, ok, mode, share = calibrated_offset(diff[r].tolist(), **cal)
        good = diff[r] == offset
        st[r] = np.where(good, PASS, FAIL)
        out.append({"provider": provider, "dataset": dataset, "records": len(r), "prompt_offset": offset,
                    "calibrated": ok, "mode": mode, "mode_share": round(share, 4), "off_offset": int((~good).sum())})
    return {"prompt.billed_count": st}, out


def _view_hash(view: tuple[Any, ...]) -> int:
    """128-bit hash of a `_reply_view` (sorted JSON; its repr where a value is no JSON)."""
    try:
        data = orjson.dumps(view, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        data = repr(view).encode()
    return xxhash.xxh3_128_intdigest(data)


def on_policy_facts(table: IdTable) -> list[tuple[int | None, list[int]] | None]:
    """Per row, what `prompt.on_policy` needs of it, without its texts: for a turn record (a row with `turn`) the
    hash of the reply it puts into later turns' history (`turns.assistant_message`; None when its fields make
    none) and the hashes of its own history's assistant messages, in order; None for other rows, and for every
    row of a table read without its messages (the check is then not run)."""
    n = len(table)
    m = table.meta
    if n == 0 or "turn" not in m or table.messages is None:
        return [None] * n

    def field(name: str, i: int) -> Any:
        col = getattr(table, name)
        return col[i] if col is not None else None

    out: list[tuple[int | None, list[int]] | None] = []
    for i, t in enumerate(m["turn"].tolist()):
        if t is None or t != t:
            out.append(None)
            continue
        try:
            own: int | None = _view_hash(_reply_view(assistant_message(
                {"reasoning": field("reasoning", i), "content": field("content", i), "tool_calls": field("tool_calls", i)})))
        except Exception:  # noqa: BLE001 - fields no reply can be made of: no history matches it
            own = None
        hist = [_view_hash(_reply_view(x)) for x in table.messages[i] or []
                if isinstance(x, dict) and x.get("role") == "assistant"]
        out.append((own, hist))
    return out


def on_policy_checks(table: Any, facts: list[tuple[int | None, list[int]] | None] | None = None
                     ) -> dict[str, np.ndarray]:
    """`prompt.on_policy` per record: a turn record's history (its `messages`) holds, as its assistant
    messages in order, exactly the replies of the conversation's turns before it, as their journaled
    records say (`turns.assistant_message` of their reasoning/content/tool_calls; 03's
    `text.fields_match` ties those to the ids). A history with the dataset's own reply, a reply of
    another turn, or an earlier turn without a completed record fails. n/a for records without `turn`.
    Replies are compared by `on_policy_facts` (given for a table whose texts were let go)."""
    n = len(table)
    st = np.full(n, NA, np.int8)
    m = table.meta
    if n == 0 or "turn" not in m or not m["turn"].notna().any():
        return {"prompt.on_policy": st}
    facts = on_policy_facts(table) if facts is None else facts
    fr = m["finish_reason"].tolist()
    conv: dict[tuple[str, str], dict[int, int]] = {}
    for i, (d, sid, t) in enumerate(zip(m["dataset"], m["sample_id"], m["turn"])):
        if t is not None and t == t:
            conv.setdefault((str(d), str(sid)), {})[int(t)] = i
    for turns in conv.values():
        for t, i in turns.items():
            if facts[i] is None:  # read without its messages
                st[i] = NOT_RUN
                continue
            hist = facts[i][1]
            ok = len(hist) == t
            for k in range(t) if ok else ():
                j = turns.get(k)
                if j is None or fr[j] != "stop" or facts[j] is None or facts[j][0] != hist[k]:
                    ok = False
                    break
            st[i] = PASS if ok else FAIL
    return {"prompt.on_policy": st}


def iter_checks(profile: Profile) -> Iterable[Check]:
    """The checks that apply to a profile."""
    return (c for c in _CHECK_LIST if c.applies(profile))
