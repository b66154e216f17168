"""Stage 02: rebuild token ids from API text, grade what is proven, and measure how often re-tokenizing lies.

An API returns text (reasoning, content, structured tool calls), not ids. `rebuild_batch`
assembles one assistant turn per record the way the profile's model spells it
(reasoning-open unless the prompt opened reasoning, reasoning, reasoning-close, content,
native tool-call tokens, end-of-turn; no reasoning block when the prompt's template closed
reasoning), encodes all records with one batched tokenizer call (spans the provider gave
per-token output for keep the provider's ids: `provider_tokens`), and verifies each with
checks named for what they prove: `ids_spell_text` (decode roundtrip),
`structure_tokens_whole` (each structural token its own id on its span: a tokenizer check
that cannot fail on the shipped vocabularies), `count_on_offset` (billed completion tokens
against the rebuilt length, exactly, after the offset calibrated per (provider, dataset,
end)) and `reasoning_count_on_offset` (billed reasoning tokens against the reasoning span).
Each record gets a proof level (`PROOF_LEVELS`: token > count > text > failed; journal
records with exact ids are `engine`). Anything odd is flagged, never silently fixed.

Where the true ids are known (local/SGLang records), `measure_drift` splits them into what an
API would return, rebuilds, grades, and compares: the exact-match rate per proof level tells
how far to trust the API part of a mixed dataset.

`run_reconstruct(params)` does both for a run: `reconstruct/<dataset>.jsonl` (rebuilt API
records), `reconstruct/summary.json` (with the calibration table), `reconstruct/drift.json`.
The journal is never touched. The stage streams, its memory set by `reconstruct.batch_size`
and not by the run: the journal is read a chunk at a time (`core.stream`); a dataset's lines
are rebuilt batch by batch into `<dataset>.jsonl.part` with only the small facts its
calibration needs kept, then graded line by line into the final file (renamed into place);
summaries and drift add up per line. A killed run leaves no `*.jsonl` half written.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Sequence

import numpy as np
import orjson

from eagle3data.core.atomic import atomic_path, write_atomic
from eagle3data.core.profiles import Profile, get_profile
from eagle3data.core.stats import calibrated_offset, wilson_interval

from eagle3data.rebuild.assemble import ApiTurn
from eagle3data.rebuild.proof import FLAGS, PROOF_LEVELS, PROOF_RANK, PROOF_MEANING, Rebuilt, grade_facts
from eagle3data.rebuild.text import first_diff, rebuild_batch
from eagle3data.rebuild.provider_tokens import fast_backend
from eagle3data.core.models import tokenizer_for
from eagle3data.core.provenance import write_provenance
from eagle3data.core.stream import index_journal
from eagle3data.core.spans import output_texts_batch
from eagle3data.prompts.load import Prompt, messages_for_template


# ---------------------------------------------------------------- exact records as an API would return them


def turns_from_exact(records: Sequence[dict[str, Any]], tokenizer: Any, profile: Profile) -> list[ApiTurn]:
    """API-style turns (text only) of records with exact ids: the one split (`spans.output_texts_batch`)."""
    texts = output_texts_batch([r["output_ids"] for r in records], profile, tokenizer)
    return [ApiTurn(reasoning=t.reasoning, content=t.content, tool_calls=t.tool_calls,
                    finish_reason=r["finish_reason"], prompt_ids=r.get("prompt_ids"),
                    billed_tokens=(r.get("usage") or {}).get("completion_tokens"),
                    billed_reasoning_tokens=(r.get("usage") or {}).get("reasoning_tokens"))
            for r, t in zip(records, texts)]


# ---------------------------------------------------------------- statistics


def _token_view(tokenizer: Any, ids: Sequence[int]) -> list[list[Any]]:
    bt = fast_backend(tokenizer)
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
    by_level: dict[str, dict[str, int]] = field(default_factory=dict)  # proof level the rebuild got -> n, exact


def measure_drift(records: Iterable[dict[str, Any]], tokenizer: Any, profile: Profile, *, dataset: str = "",
                  examples: int = 3, window: int = 4, seam_check: str = "offsets", rp: Any = None) -> DriftResult:
    """Decode exact records, split as an API would, rebuild, and compare with the true ids.

    The rebuilds are graded as API records would be (offsets calibrated on these records), so
    `by_level` tells how often a rebuild at each proof level is in fact right. `records` is read
    once, `rp.batch_size` at a time; of each rebuild only its grading facts are kept (one
    `Rebuilt` without ids per distinct facts and group, referenced per record) until the
    calibration over all of them grades it.
    """
    bt = fast_backend(tokenizer)
    groups: dict[tuple[str, str, str], list[Rebuilt]] = {}
    slim: dict[tuple[Any, ...], Rebuilt] = {}
    graded: list[tuple[Rebuilt, bool]] = []  # per record: its facts, and whether the rebuild was exact
    n = exact = text_equal = 0
    divs: list[int] = []
    ex: list[dict[str, Any]] = []
    recs = (r for r in records if r.get("output_ids") is not None and r.get("finish_reason") != "error")
    for batch in _batches(recs, getattr(rp, "batch_size", 4096)):
        rebuilt = rebuild_batch(turns_from_exact(batch, tokenizer, profile), tokenizer, profile,
                                seam_check=seam_check, count_tolerance=float("inf"))
        truth_texts = bt.decode_batch([list(r["output_ids"]) for r in batch], skip_special_tokens=False)
        for r, rb, tt in zip(batch, rebuilt, truth_texts):
            key = (str(r.get("provider") or r.get("source") or "unknown"), dataset, _end_of(r.get("finish_reason")))
            facts = (key, tuple(rb.flags), rb.count_diff, rb.billed_tokens, rb.reasoning_diff,
                     tuple(rb.token_exact_spans), tuple(rb.needed_spans), rb.roundtrip_ok, rb.seam_ok)
            kept = slim.get(facts) or slim.setdefault(facts, replace(rb, output_ids=[], text=""))
            groups.setdefault(key, []).append(kept)
            true_ids = list(r["output_ids"])
            n += 1
            text_equal += int(tt == rb.text)
            d = first_diff(true_ids, rb.output_ids)
            graded.append((kept, d is None))
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
    calibrate(groups, **({} if rp is None else rp.count_calibration))
    by_level: dict[str, dict[str, int]] = {}
    for kept, right in graded:
        lv = by_level.setdefault(kept.proof_level, {"n": 0, "exact": 0})
        lv["n"] += 1
        lv["exact"] += int(right)
    return DriftResult(dataset, n, exact, text_equal, exact / n if n else float("nan"), wilson_interval(exact, n),
                       divs, ex, by_level)


# ---------------------------------------------------------------- the stage


def _prompt_ids_for(recs: list[dict[str, Any]], tokenizer: Any, profile: Profile) -> list[list[int] | None]:
    """Prompt ids of API records; missing ones are templated (rendered per record, encoded in one batch)."""
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
        for i, e in zip(need, fast_backend(tokenizer).encode_batch_fast(texts, add_special_tokens=False)):
            out[i] = e.ids
    return out


def _end_of(finish_reason: str | None) -> str:
    return "length" if finish_reason in ("length", "abort") else "stop"


def _batches(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    """Lists of `n` items; a list is let go before the next is read (two are never held at once here)."""
    it = iter(items)
    while True:
        batch = list(itertools.islice(it, max(1, int(n))))
        if not batch:
            return
        yield batch
        del batch


@dataclass
class _Group:
    """One (provider, dataset, end) group's calibration: its records' count differences, then its offsets."""

    records: int = 0
    diffs: list[int] = field(default_factory=list)
    r_diffs: list[int] = field(default_factory=list)
    learned: dict[str, Any] = field(default_factory=dict)
    off: int = 0
    r_off: int = 0

    def add(self, count_diff: int | None, reasoning_diff: int | None) -> None:
        self.records += 1
        if count_diff is not None:
            self.diffs.append(count_diff)
        if reasoning_diff is not None:
            self.r_diffs.append(reasoning_diff)

    def learn(self, *, min_records: int = 10, min_share: float = 0.6, max_offset: int = 3) -> tuple[int, int | None]:
        """The group's (count offset, reasoning offset): the rule of `calibrate`."""
        kw = {"min_records": min_records, "min_share": min_share, "max_offset": max_offset}
        count_offset, ok, off, share = calibrated_offset(self.diffs, **kw)
        r_cal, r_ok, r_off, r_share = calibrated_offset(self.r_diffs, **kw)
        # reasoning counts: too few records -> offset 0, like the total; enough but scattered -> not used (None)
        reasoning_offset = r_cal if r_ok else (0 if len(self.r_diffs) < min_records else None)
        self.learned = {"count_offset": count_offset, "calibrated": ok, "mode": off, "mode_share": round(share, 4),
                        "reasoning_offset": reasoning_offset, "reasoning_calibrated": r_ok, "reasoning_mode": r_off,
                        "reasoning_mode_share": round(r_share, 4)}
        return count_offset, reasoning_offset

    def graded(self, flags: list[str]) -> None:
        self.off += "count_off_offset" in flags
        self.r_off += "reasoning_count_off_offset" in flags

    def row(self, key: tuple[str, str, str]) -> dict[str, Any]:
        lr = self.learned
        return {"provider": key[0], "dataset": key[1], "end": key[2], "records": self.records,
                "billed": len(self.diffs), "count_offset": lr["count_offset"], "calibrated": lr["calibrated"],
                "mode": lr["mode"], "mode_share": lr["mode_share"], "off_offset": self.off,
                "reasoning_billed": len(self.r_diffs), "reasoning_offset": lr["reasoning_offset"],
                "reasoning_calibrated": lr["reasoning_calibrated"], "reasoning_mode": lr["reasoning_mode"],
                "reasoning_mode_share": lr["reasoning_mode_share"], "reasoning_off_offset": self.r_off}


def calibrate(groups: dict[tuple[str, str, str], list[Rebuilt]], *, min_records: int = 10, min_share: float = 0.6,
              max_offset: int = 3) -> list[dict[str, Any]]:
    """Learn per (provider, dataset, end) how billed counts relate to rebuilt lengths; grade every record with it.

    The offset is the most common `rebuilt - billed` of the group (e.g. +1 where a provider
    does not bill the end-of-turn the rebuild appends). It is used when the group has at
    least `min_records` billed records, the offset holds for at least `min_share` of them
    and `|offset| <= max_offset`; otherwise the offset is 0 (billed == rebuilt). The same
    for the reasoning span against billed reasoning tokens, except that a group with enough
    records whose reasoning counts scatter does not use them (offset None: not checked).
    Each record is graded against its group's offsets; returns the calibration table (one
    row per group).
    """
    table = []
    for key in sorted(groups):
        g = _Group()
        for rb in groups[key]:
            g.add(rb.count_diff, rb.reasoning_diff)
        count_offset, reasoning_offset = g.learn(min_records=min_records, min_share=min_share, max_offset=max_offset)
        for rb in groups[key]:
            g.graded(rb.grade(count_offset, reasoning_offset).flags)
        table.append(g.row(key))
    return table


# a line's fields before its id lists (the rest follow them); `_ids_json` writes the id lists
_HEAD = ("dataset", "sample_id", "source", "provider", "ids_exact", "proof_level")


def _ids_json(prompt: list[int], output: list[int]) -> bytes:
    """`"prompt_ids":[..],"output_ids":[..],"input_ids":[..],"loss_mask":[..]` as orjson writes them in a line."""
    p, o = orjson.dumps(prompt), orjson.dumps(output)
    both = o if not prompt else p if not output else p[:-1] + b"," + o[1:]
    mask = b"[" + (b"0," * len(prompt) + b"1," * len(output))[:-1] + b"]"
    return b'"prompt_ids":' + p + b',"output_ids":' + o + b',"input_ids":' + both + b',"loss_mask":' + mask


def _ungraded(r: dict[str, Any], p: list[int], rb: Rebuilt) -> bytes:
    """Pass 1's line: the line's small fields (grade pending) and what grading needs, a tab, the id lists."""
    small = {"dataset": r["dataset"], "sample_id": r["sample_id"], "source": r.get("source"),
             "provider": r.get("provider"), "ids_exact": False, "proof_level": None,
             "flags": rb.flags, "checks": None, "token_exact_spans": rb.token_exact_spans,
             "seam_ok": rb.seam_ok, "seam_first_diff": rb.seam_first_diff,
             "roundtrip_ok": rb.roundtrip_ok, "billed_tokens": rb.billed_tokens,
             "rebuilt_tokens": len(rb.output_ids), "count_diff": rb.count_diff, "count_offset": None,
             "billed_reasoning_tokens": rb.billed_reasoning, "rebuilt_reasoning_tokens": rb.reasoning_rebuilt,
             "reasoning_diff": rb.reasoning_diff, "reasoning_offset": None,
             "finish_reason": r["finish_reason"],
             **({"turn": r["turn"]} if r.get("turn") is not None else {}),  # the one key of a turn record
             "_needed": rb.needed_spans, "_templated": r.get("prompt_ids") is None and bool(p)}
    return orjson.dumps(small) + b"\t" + _ids_json(p, rb.output_ids) + b"\n"  # JSON holds no raw tab


def _key_of(ln: dict[str, Any]) -> tuple[str, str, str]:
    return str(ln.get("provider") or "unknown"), str(ln["dataset"]), _end_of(ln["finish_reason"])


def _graded(part_line: bytes, groups: dict[tuple[str, str, str], _Group], offsets: dict[Any, Any],
            tolerance: float) -> tuple[bytes, dict[str, Any]]:
    """Pass 2: a pass-1 line graded against its group's offsets -> (the final line, its fields but the id lists)."""
    small, _, ids = part_line.rstrip(b"\n").partition(b"\t")
    ln = orjson.loads(small)
    needed, templated = ln.pop("_needed"), ln.pop("_templated")
    key = _key_of(ln)
    count_offset, reasoning_offset = offsets[key]
    flags, level, checks = grade_facts(ln["flags"], ln["count_diff"], ln["billed_tokens"], ln["reasoning_diff"],
                                       ln["token_exact_spans"], needed, ln["roundtrip_ok"], ln["seam_ok"],
                                       count_offset, reasoning_offset, tolerance)
    groups[key].graded(flags)
    ln.update(proof_level=level, flags=flags + (["prompt_templated_here"] if templated else []), checks=checks,
              count_offset=count_offset, reasoning_offset=reasoning_offset)
    head = orjson.dumps({k: ln[k] for k in _HEAD})
    tail = orjson.dumps({k: v for k, v in ln.items() if k not in _HEAD})
    return head[:-1] + b"," + ids + b"," + tail[1:] + b"\n", ln


def reconstruct_records(recs: Iterable[dict[str, Any]], tokenizer: Any, profile: Profile, rp: Any,
                        calibration: list[dict[str, Any]] | None = None, *, into: BinaryIO | None = None,
                        part: Path | None = None, each: Callable[[dict[str, Any]], Any] | None = None
                        ) -> list[dict[str, Any]]:
    """Output lines of `reconstruct/<dataset>.jsonl` for API records (errors skipped).

    Every record is graded against the offsets calibrated on all these records per (provider,
    dataset, end); the calibration rows are appended to `calibration` when given. `recs` is
    read once (any iterable), `rp.batch_size` records at a time. Pass 1 rebuilds each batch and
    keeps its lines ungraded (in memory, or in the file `part`, rewritten from scratch and
    removed at the end), holding only each record's count differences per group; pass 2 reads
    them back one at a time and grades them. Returns the lines; with `into` (a binary file)
    they are written there instead, and [] is returned. `each` gets every line without its id
    lists (for the summaries).
    """
    groups: dict[tuple[str, str, str], _Group] = {}
    kept: list[bytes] = []
    try:
        with open(part, "wb") if part is not None else contextlib.nullcontext() as sink:
            put = kept.append if sink is None else sink.write
            for chunk in _batches((r for r in recs if r.get("finish_reason") != "error"), rp.batch_size):
                prompts = _prompt_ids_for(chunk, tokenizer, profile)
                usage = [r.get("usage") or {} for r in chunk]
                turns = [ApiTurn(r.get("reasoning"), r.get("content"), r.get("tool_calls"), r["finish_reason"], p,
                                 u.get("completion_tokens"), u.get("reasoning_tokens"), r.get("logprobs"))
                         for r, p, u in zip(chunk, prompts, usage)]
                rebuilt = rebuild_batch(turns, tokenizer, profile, count_tolerance=rp.count_tolerance,
                                        seam_check=rp.seam_check, append_guard=rp.append_guard)
                for r, p, rb in zip(chunk, prompts, rebuilt):
                    groups.setdefault(_key_of(r), _Group()).add(rb.count_diff, rb.reasoning_diff)
                    put(_ungraded(r, list(p or []), rb))
                del chunk, prompts, usage, turns, rebuilt  # before the next batch is read
        offsets = {k: g.learn(**rp.count_calibration) for k, g in groups.items()}
        out: list[dict[str, Any]] = []
        with open(part, "rb") if part is not None else contextlib.nullcontext(kept) as part_lines:
            for part_line in part_lines:
                line, small = _graded(part_line, groups, offsets, rp.count_tolerance)
                if into is not None:
                    into.write(line)
                else:
                    out.append(orjson.loads(line))
                if each is not None:
                    each(small)
    finally:
        if part is not None:
            part.unlink(missing_ok=True)
    if calibration is not None:
        calibration += [groups[k].row(k) for k in sorted(groups)]
    return out


class _Summary:
    """summary.json's tallies, added up one written line at a time: per dataset, per provider, overall, and the
    proof levels per (dataset, provider)."""

    def __init__(self) -> None:
        self.records = 0
        self.by: dict[str, dict[str, dict[str, Any]]] = {"dataset": {}, "provider": {}, "all": {}}
        self.levels: dict[tuple[str, str], dict[str, int]] = {}

    def add(self, ln: dict[str, Any]) -> None:
        self.records += 1
        lv = ln.get("proof_level") or "unknown"
        for key, acc in self.by.items():
            a = acc.setdefault("all" if key == "all" else str(ln.get(key) or "unknown"), {
                "records": 0, "seam_failures": 0, "roundtrip_failures": 0, "billed_tokens": 0,
                "rebuilt_tokens_billed": 0, "abs_count_diff": 0, "count_outside_tolerance": 0,
                "count_off_offset": 0, "proof_levels": {}, "flags": {}})
            a["records"] += 1
            a["seam_failures"] += int(not ln["seam_ok"])
            a["roundtrip_failures"] += int(not ln["roundtrip_ok"])
            if ln["billed_tokens"] is not None:
                a["billed_tokens"] += ln["billed_tokens"]
                a["rebuilt_tokens_billed"] += ln["rebuilt_tokens"]
                a["abs_count_diff"] += abs(ln["count_diff"])
            a["proof_levels"][lv] = a["proof_levels"].get(lv, 0) + 1
            for f in ln["flags"]:
                a["flags"][f] = a["flags"].get(f, 0) + 1
            a["count_outside_tolerance"] = a["flags"].get("count_outside_tolerance", 0)
            a["count_off_offset"] = a["flags"].get("count_off_offset", 0)
        c = self.levels.setdefault((str(ln["dataset"]), str(ln.get("provider") or "unknown")), {})
        c[lv] = c.get(lv, 0) + 1

    def per(self, key: str) -> dict[str, dict[str, Any]]:
        """Per-`key` (dataset, provider or all) counts: records, proof levels, flags, seam/roundtrip failures, count
        agreement."""
        acc = self.by[key]
        for a in acc.values():
            b = a["billed_tokens"]
            a["count_diff_pct"] = 100.0 * (a["rebuilt_tokens_billed"] - b) / b if b else None
            a["abs_count_diff_pct"] = 100.0 * a["abs_count_diff"] / b if b else None
        return acc

    def levels_by(self) -> list[dict[str, Any]]:
        """Records per proof level for each (dataset, provider)."""
        return [{"dataset": ds, "provider": pv, "records": sum(lv.values()), "levels": lv}
                for (ds, pv), lv in sorted(self.levels.items())]


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
                "abs_count_diff_pct", "count_outside_tolerance", "count_off_offset"]
        return pd.DataFrame(rows, columns=cols).set_index("dataset")

    def provider_table(self):
        """Per-provider count agreement of API records."""
        import pandas as pd

        rows = [{"provider": k, **{c: v for c, v in a.items() if c != "flags"}}
                for k, a in self.summary["providers"].items()]
        cols = ["provider", "records", "billed_tokens", "count_diff_pct", "abs_count_diff_pct",
                "count_outside_tolerance", "count_off_offset"]
        return pd.DataFrame(rows, columns=cols).set_index("provider")

    def level_table(self):
        """Share of API records at each proof level per (dataset, provider), with the record count."""
        import pandas as pd

        rows = [{"dataset": r["dataset"], "provider": r["provider"], "records": r["records"],
                 **{lv: c / r["records"] for lv, c in r["levels"].items()}}
                for r in self.summary.get("levels_by_dataset_provider", [])]
        cols = ["dataset", "provider", "records", *[lv for lv in reversed(PROOF_LEVELS) if lv != "engine"]]
        df = pd.DataFrame(rows, columns=cols)
        return df.fillna(0.0).set_index(["dataset", "provider"])

    def calibration_table(self):
        """Per (provider, dataset, end): the learned offset of billed counts and how many records are off it."""
        import pandas as pd

        cols = ["provider", "dataset", "end", "records", "billed", "count_offset", "calibrated", "mode", "mode_share",
                "off_offset", "reasoning_billed", "reasoning_offset", "reasoning_calibrated", "reasoning_off_offset"]
        return pd.DataFrame(self.summary.get("calibration", []), columns=cols).set_index(["provider", "dataset", "end"])

    def drift_level_table(self):
        """Drift per proof level: of the exact records rebuilt from their text, how many at each level were right."""
        import pandas as pd

        rows = []
        for k, d in self.drift["datasets"].items():
            for lv, c in sorted(d.get("by_level", {}).items(), key=lambda kv: -PROOF_RANK.get(kv[0], -1)):
                lo, hi = wilson_interval(c["exact"], c["n"])
                rows.append({"dataset": k, "proof_level": lv, "records": c["n"], "exact": c["exact"],
                             "exact_rate": c["exact"] / c["n"] if c["n"] else None, "ci95_low": lo, "ci95_high": hi})
        cols = ["dataset", "proof_level", "records", "exact", "exact_rate", "ci95_low", "ci95_high"]
        return pd.DataFrame(rows, columns=cols).set_index(["dataset", "proof_level"])

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


# the journal is read this many records at a time at most (fewer when `reconstruct.batch_size` is smaller)
_READ_CHUNK = 256


def _api_records(index: Any, read: int, skipped: dict[str, int], exact_at: list[int]) -> Iterator[dict[str, Any]]:
    """A journal's API records (the record of each sample: a retried error is superseded), `read` at a time;
    counts their errors into `skipped` and notes where the exact records are (their lines in `index`)."""
    where = iter(index.record_lines().tolist())
    for chunk in index.iter_records(read):
        for r in chunk:
            at = next(where)
            if r.get("source") == "api" and r.get("output_ids") is None:
                skipped[index.name] += r.get("finish_reason") == "error"
                yield r
            elif r.get("ids_exact") and r.get("output_ids") is not None:
                exact_at.append(at)


def run_reconstruct(params: Any, progress: bool = True, tokenizer: Any = None) -> ReconstructResult:
    """Stage 02 on a run: rebuild API records beside the journal, measure drift on exact records.

    Streams, dataset by dataset: the journal is indexed (`core.stream`), its API records rebuilt
    into `<dataset>.jsonl.part` and graded into `<dataset>.jsonl` (`reconstruct_records`, the
    final file renamed into place), and its exact records, read back by position, measured for
    drift. A `.part` or `.tmp` file left by a killed run is removed first (later stages read
    `*.jsonl` only, which neither name matches).
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    rp = params.reconstruct
    profile = get_profile(params.profile)
    tokenizer = tokenizer or tokenizer_for(params)
    run_dir = params.run_dir
    out_dir = run_dir / "reconstruct"
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("*.jsonl.part"), *out_dir.glob("*.jsonl.tmp")]:  # a killed run's
        stale.unlink()
    write_provenance(run_dir, "02_reconstruct", params)
    tally = _Summary()
    calibration: list[dict[str, Any]] = []
    drift: dict[str, Any] = {"datasets": {}}
    skipped: dict[str, int] = {}
    read = min(_READ_CHUNK, rp.batch_size)
    for d in tqdm(params.datasets, desc="reconstruct", unit="dataset", disable=not progress):
        index = index_journal(run_dir, d.name)
        exact_at: list[int] = []
        skipped[d.name] = 0
        target = out_dir / f"{d.name}.jsonl"
        before = tally.records
        with atomic_path(target) as tmp, open(tmp, "wb") as f:
            reconstruct_records(_api_records(index, read, skipped, exact_at), tokenizer, profile, rp, calibration,
                                into=f, part=out_dir / f"{d.name}.jsonl.part", each=tally.add)
        if tally.records == before:
            target.unlink()  # no API record: no file (a stale one from an earlier run would be read as this run's)
        if rp.drift and exact_at:
            exact = (r for chunk in index.iter_lines(np.asarray(exact_at, np.int64), read) for r in chunk)
            dr = measure_drift(exact, tokenizer, profile, dataset=d.name, examples=rp.drift_examples,
                               seam_check=rp.seam_check, rp=rp)
            drift["datasets"][d.name] = dr.__dict__ | {"ci95": list(dr.ci95)}
    tot_n = sum(v["n"] for v in drift["datasets"].values())
    tot_k = sum(v["exact"] for v in drift["datasets"].values())
    drift["overall"] = {"n": tot_n, "exact": tot_k, "rate": tot_k / tot_n if tot_n else None,
                        "ci95": list(wilson_interval(tot_k, tot_n))}
    summary = {"profile": profile.name, "api_records": tally.records, "errors_skipped": skipped,
               "datasets": tally.per("dataset"), "providers": tally.per("provider"),
               "overall": tally.per("all").get("all"),
               "flags_meaning": FLAGS, "proof_levels_meaning": PROOF_MEANING, "calibration": calibration,
               "levels_by_dataset_provider": tally.levels_by(), "params": rp.model_dump(mode="json")}
    write_atomic(out_dir / "summary.json", orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    write_atomic(out_dir / "drift.json", orjson.dumps(drift, option=orjson.OPT_INDENT_2))
    return ReconstructResult(run_dir, summary, drift, time.perf_counter() - t0)


# ---------------------------------------------------------------- tool calls as APIs return them


def tool_call(name: str, arguments: dict[str, Any] | str, call_id: str | None = None) -> dict[str, Any]:
    """An OpenAI-format tool call (arguments as JSON text, the way APIs return them)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or f"call_{name}", "type": "function", "function": {"name": name, "arguments": args}}
