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
The journal is never touched.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import orjson

from eagle3data.core.atomic import write_atomic
from eagle3data.core.profiles import Profile, get_profile
from eagle3data.core.stats import calibrated_offset, wilson_interval

from eagle3data.rebuild.assemble import ApiTurn
from eagle3data.rebuild.proof import FLAGS, PROOF_LEVELS, PROOF_RANK, PROOF_MEANING, Rebuilt
from eagle3data.rebuild.text import first_diff, rebuild_batch
from eagle3data.rebuild.provider_tokens import fast_backend
from eagle3data.core.models import tokenizer_for
from eagle3data.core.provenance import write_provenance
from eagle3data.core.reader import read_run
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


def measure_drift(records: Sequence[dict[str, Any]], tokenizer: Any, profile: Profile, *, dataset: str = "",
                  examples: int = 3, window: int = 4, seam_check: str = "offsets", rp: Any = None) -> DriftResult:
    """Decode exact records, split as an API would, rebuild, and compare with the true ids.

    The rebuilds are graded as API records would be (offsets calibrated on these records), so
    `by_level` tells how often a rebuild at each proof level is in fact right.
    """
    recs = [r for r in records if r.get("output_ids") is not None and r.get("finish_reason") != "error"]
    turns = turns_from_exact(recs, tokenizer, profile)
    rebuilt = rebuild_batch(turns, tokenizer, profile, seam_check=seam_check, count_tolerance=float("inf"))
    groups: dict[tuple[str, str, str], list[Rebuilt]] = {}
    for r, rb in zip(recs, rebuilt):
        groups.setdefault((str(r.get("provider") or r.get("source") or "unknown"), dataset,
                           _end_of(r.get("finish_reason"))), []).append(rb)
    calibrate(groups, **({} if rp is None else rp.count_calibration))
    truth_texts = fast_backend(tokenizer).decode_batch([list(r["output_ids"]) for r in recs], skip_special_tokens=False)
    exact = text_equal = 0
    divs: list[int] = []
    ex: list[dict[str, Any]] = []
    by_level: dict[str, dict[str, int]] = {}
    for r, rb, tt in zip(recs, rebuilt, truth_texts):
        true_ids = list(r["output_ids"])
        text_equal += int(tt == rb.text)
        d = first_diff(true_ids, rb.output_ids)
        lv = by_level.setdefault(rb.proof_level, {"n": 0, "exact": 0})
        lv["n"] += 1
        if d is None:
            exact += 1
            lv["exact"] += 1
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
    for (provider, dataset, end), rbs in sorted(groups.items()):
        diffs = [rb.count_diff for rb in rbs if rb.count_diff is not None]
        count_offset, ok, off, share = calibrated_offset(diffs, min_records=min_records, min_share=min_share,
                                                         max_offset=max_offset)
        r_diffs = [rb.reasoning_diff for rb in rbs if rb.reasoning_diff is not None]
        r_cal, r_ok, r_off, r_share = calibrated_offset(r_diffs, min_records=min_records, min_share=min_share,
                                                        max_offset=max_offset)
        # reasoning counts: too few records -> offset 0, like the total; enough but scattered -> not used (None)
        reasoning_offset = r_cal if r_ok else (0 if len(r_diffs) < min_records else None)
        for rb in rbs:
            rb.grade(count_offset, reasoning_offset)
        table.append({
            "provider": provider, "dataset": dataset, "end": end, "records": len(rbs), "billed": len(diffs),
            "count_offset": count_offset, "calibrated": ok, "mode": off, "mode_share": round(share, 4),
            "off_offset": sum(1 for rb in rbs if "count_off_offset" in rb.flags),
            "reasoning_billed": len(r_diffs), "reasoning_offset": reasoning_offset, "reasoning_calibrated": r_ok,
            "reasoning_mode": r_off, "reasoning_mode_share": round(r_share, 4),
            "reasoning_off_offset": sum(1 for rb in rbs if "reasoning_count_off_offset" in rb.flags),
        })
    return table


def reconstruct_records(recs: list[dict[str, Any]], tokenizer: Any, profile: Profile, rp: Any,
                        calibration: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Output lines of `reconstruct/<dataset>.jsonl` for API records (errors skipped).

    Every record is graded against the offsets calibrated on these records per (provider,
    dataset, end); the calibration rows are appended to `calibration` when given.
    """
    recs = [r for r in recs if r.get("finish_reason") != "error"]
    done: list[tuple[dict[str, Any], list[int], Rebuilt]] = []
    for lo in range(0, len(recs), rp.batch_size):
        chunk = recs[lo : lo + rp.batch_size]
        prompts = _prompt_ids_for(chunk, tokenizer, profile)
        turns = [ApiTurn(r.get("reasoning"), r.get("content"), r.get("tool_calls"), r["finish_reason"], p,
                         (r.get("usage") or {}).get("completion_tokens"),
                         (r.get("usage") or {}).get("reasoning_tokens"), r.get("logprobs"))
                 for r, p in zip(chunk, prompts)]
        rebuilt = rebuild_batch(turns, tokenizer, profile, count_tolerance=rp.count_tolerance,
                                seam_check=rp.seam_check, append_guard=rp.append_guard)
        done += [(r, list(p or []), rb) for r, p, rb in zip(chunk, prompts, rebuilt)]
    groups: dict[tuple[str, str, str], list[Rebuilt]] = {}
    for r, _, rb in done:
        groups.setdefault((str(r.get("provider") or "unknown"), str(r["dataset"]), _end_of(r["finish_reason"])),
                          []).append(rb)
    table = calibrate(groups, **rp.count_calibration)
    if calibration is not None:
        calibration += table
    out: list[dict[str, Any]] = []
    for r, p, rb in done:
        flags = rb.flags + (["prompt_templated_here"] if r.get("prompt_ids") is None and p else [])
        out.append({
            "dataset": r["dataset"], "sample_id": r["sample_id"], "source": r.get("source"),
            "provider": r.get("provider"), "ids_exact": False, "proof_level": rb.proof_level,
            "prompt_ids": p, "output_ids": rb.output_ids,
            "input_ids": p + rb.output_ids, "loss_mask": [0] * len(p) + [1] * len(rb.output_ids),
            "flags": flags, "checks": rb.checks, "token_exact_spans": rb.token_exact_spans,
            "seam_ok": rb.seam_ok, "seam_first_diff": rb.seam_first_diff,
            "roundtrip_ok": rb.roundtrip_ok, "billed_tokens": rb.billed_tokens,
            "rebuilt_tokens": len(rb.output_ids), "count_diff": rb.count_diff, "count_offset": rb.count_offset,
            "billed_reasoning_tokens": rb.billed_reasoning, "rebuilt_reasoning_tokens": rb.reasoning_rebuilt,
            "reasoning_diff": rb.reasoning_diff, "reasoning_offset": rb.reasoning_offset,
            "finish_reason": r["finish_reason"],
            **({"turn": r["turn"]} if r.get("turn") is not None else {}),  # the one key of a turn record
        })
    return out


def summarize(lines: Iterable[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """Per-`key` (dataset or provider) counts: records, proof levels, flags, seam/roundtrip failures, count agreement."""
    acc: dict[str, dict[str, Any]] = {}
    for ln in lines:
        k = str(ln.get(key) or "unknown")
        a = acc.setdefault(k, {"records": 0, "seam_failures": 0, "roundtrip_failures": 0, "billed_tokens": 0,
                               "rebuilt_tokens_billed": 0, "abs_count_diff": 0, "count_outside_tolerance": 0,
                               "count_off_offset": 0, "proof_levels": {}, "flags": {}})
        a["records"] += 1
        a["seam_failures"] += int(not ln["seam_ok"])
        a["roundtrip_failures"] += int(not ln["roundtrip_ok"])
        if ln["billed_tokens"] is not None:
            a["billed_tokens"] += ln["billed_tokens"]
            a["rebuilt_tokens_billed"] += ln["rebuilt_tokens"]
            a["abs_count_diff"] += abs(ln["count_diff"])
        lv = ln.get("proof_level") or "unknown"
        a["proof_levels"][lv] = a["proof_levels"].get(lv, 0) + 1
        for f in ln["flags"]:
            a["flags"][f] = a["flags"].get(f, 0) + 1
        a["count_outside_tolerance"] = a["flags"].get("count_outside_tolerance", 0)
        a["count_off_offset"] = a["flags"].get("count_off_offset", 0)
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


def _levels_by(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records per proof level for each (dataset, provider)."""
    acc: dict[tuple[str, str], dict[str, int]] = {}
    for ln in lines:
        a = acc.setdefault((str(ln["dataset"]), str(ln.get("provider") or "unknown")), {})
        lv = ln.get("proof_level") or "unknown"
        a[lv] = a.get(lv, 0) + 1
    return [{"dataset": ds, "provider": pv, "records": sum(lv.values()), "levels": lv}
            for (ds, pv), lv in sorted(acc.items())]


def run_reconstruct(params: Any, progress: bool = True, tokenizer: Any = None) -> ReconstructResult:
    """Stage 02 on a run: rebuild API records beside the journal, measure drift on exact records."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    rp = params.reconstruct
    profile = get_profile(params.profile)
    tokenizer = tokenizer or tokenizer_for(params)
    run_dir = params.run_dir
    out_dir = run_dir / "reconstruct"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_provenance(run_dir, "02_reconstruct", params)
    all_lines: list[dict[str, Any]] = []
    calibration: list[dict[str, Any]] = []
    drift: dict[str, Any] = {"datasets": {}}
    skipped: dict[str, int] = {}
    view = read_run(run_dir, [d.name for d in params.datasets], rebuilt=False, verdicts=False)
    for d in tqdm(params.datasets, desc="reconstruct", unit="dataset", disable=not progress):
        recs = view.datasets[d.name].records()  # the record of each sample (a retried error is superseded)
        api = [r for r in recs if r.get("source") == "api" and r.get("output_ids") is None]
        exact = [r for r in recs if r.get("ids_exact") and r.get("output_ids") is not None]
        skipped[d.name] = sum(1 for r in api if r.get("finish_reason") == "error")
        lines = reconstruct_records(api, tokenizer, profile, rp, calibration) if api else []
        target = out_dir / f"{d.name}.jsonl"
        if lines:
            write_atomic(target, b"".join(orjson.dumps(ln) + b"\n" for ln in lines))
        elif target.exists():
            target.unlink()  # a stale file from an earlier run would be read as this run's
        all_lines += lines
        if rp.drift and exact:
            dr = measure_drift(exact, tokenizer, profile, dataset=d.name, examples=rp.drift_examples,
                               seam_check=rp.seam_check, rp=rp)
            drift["datasets"][d.name] = dr.__dict__ | {"ci95": list(dr.ci95)}
    tot_n = sum(v["n"] for v in drift["datasets"].values())
    tot_k = sum(v["exact"] for v in drift["datasets"].values())
    drift["overall"] = {"n": tot_n, "exact": tot_k, "rate": tot_k / tot_n if tot_n else None,
                        "ci95": list(wilson_interval(tot_k, tot_n))}
    summary = {"profile": profile.name, "api_records": len(all_lines), "errors_skipped": skipped,
               "datasets": summarize(all_lines, "dataset"), "providers": summarize(all_lines, "provider"),
               "overall": summarize(({**ln, "all": "all"} for ln in all_lines), "all").get("all"),
               "flags_meaning": FLAGS, "proof_levels_meaning": PROOF_MEANING, "calibration": calibration,
               "levels_by_dataset_provider": _levels_by(all_lines), "params": rp.model_dump(mode="json")}
    write_atomic(out_dir / "summary.json", orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    write_atomic(out_dir / "drift.json", orjson.dumps(drift, option=orjson.OPT_INDENT_2))
    return ReconstructResult(run_dir, summary, drift, time.perf_counter() - t0)


# ---------------------------------------------------------------- tool calls as APIs return them


def tool_call(name: str, arguments: dict[str, Any] | str, call_id: str | None = None) -> dict[str, Any]:
    """An OpenAI-format tool call (arguments as JSON text, the way APIs return them)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or f"call_{name}", "type": "function", "function": {"name": name, "arguments": args}}
