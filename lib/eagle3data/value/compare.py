"""Each 06 variant against its reference: paired τ differences (engine and offline, per temperature), and the storage
rule that reads them.

A difference is paired over the same evaluation prompts and pooled over the evaluation sets (spread.py's
`paired_diff`, a bootstrap over prompts). The reference is `exact` (its seeds' counts summed per prompt when it
trained on several) or, for a variant made from another (`variants.COMPARED_WITH`: sampled_retokenized from
sampled), that variant. Per temperature: the offline figure at every `value.eval.temperatures`, the engine's at
every temperature both sides were served at.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from eagle3data.core.params.hidden import default_storage
from eagle3data.value.sampling import temperature_key
from eagle3data.value.spread import KINDS, counts_at, counts_of, judge_diff, paired_diff
from eagle3data.value.train import ValueStageError

# The storage rule (docs/04, docs/06): an 8-bit storage becomes a layout's default only when the 95% interval of its
# engine-τ difference to `exact` proves it loses at most this share of exact's τ (its lower bound >= -share x τ).
MAX_STORAGE_LOSS = 0.01


def _per_prompt(vdir: Path, variant: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (vdir / variant / "per_prompt.jsonl").read_text(encoding="utf-8").splitlines() if x]


def _judge(est: float | None, ci: Sequence[float] | None, kind: str, spread: dict[str, Any] | None, seeds_a: int,
           out: dict[str, Any]) -> dict[str, Any] | None:
    """A Δτ judged against its evaluation interval widened by the reference's seed spread of the same kind (`spread`:
    {kind: seed_spread}); an engine Δτ whose reference's other seeds ran offline only is judged against the offline
    spread (offline and engine τ agree within a few thousandths on this target: docs/06; `out["seed_spread_of"]`
    says so). None without an interval."""
    if not ci or est is None:
        return None
    sd = (spread or {}).get(kind) or {}
    if sd.get("sd") is None and kind == "engine" and ((spread or {}).get("offline") or {}).get("sd") is not None:
        sd = spread["offline"]  # type: ignore[index]
        out["seed_spread_of"] = "offline"
    return judge_diff(est, ci, sd.get("sd"), sd["seeds"] - 1 if sd.get("sd") is not None else None,
                      seeds_a=seeds_a, seeds_b=1)


def _paired_into(out: dict[str, Any], kind: str, refs: Sequence[Sequence[tuple[float, float] | None]],
                 mine: Sequence[tuple[float, float] | None], seed: int) -> None:
    """`out["tau_<kind>"]` and its interval: the variant's per-prompt counts (`mine`) against the reference's, each
    prompt's summed over the reference's seeds measured this way (`refs`, one count list per seed: exact's other seeds
    may be measured offline only), paired over prompts; None where the variant or every seed was not measured."""
    sides = [side for side in refs if None not in side]
    if not sides or None in mine:
        out[f"tau_{kind}"], out[f"tau_{kind}_ci95"] = None, None
        return
    base = [(sum(side[i][0] for side in sides), sum(side[i][1] for side in sides)) for i in range(len(mine))]
    out[f"tau_{kind}"], out[f"tau_{kind}_ci95"] = paired_diff(base, mine, seed)
    out[f"{kind}_reference_seeds"] = len(sides)


def diff_to(vdir: Path, variant: str, reference: Sequence[str] = ("exact",), seed: int = 0,
            spread: dict[str, Any] | None = None, temperatures: Sequence[float] = (),
            spread_at: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A variant's τ difference to its reference (`reference`: the reference's folders, its seeds), engine and
    offline, paired over the same evaluation prompts, pooled over the evaluation datasets; where the interval holds 0,
    how many evaluation tokens would resolve the difference (the interval narrows as 1/√tokens). With the reference
    trained on several seeds, its side is each prompt's counts summed over its seeds, and the difference is judged
    (`judged`, `significant`) against the evaluation interval widened by the seed spread (`spread[kind]`:
    `seed_spread` of the pooled τ; spread.py's rule); otherwise against the evaluation interval alone.
    `by_temperature`: the same per temperature (T = 0's engine figure is `tau_engine`'s), each judged (`judged`,
    `significant`: engine where both sides were served, else offline) against the seed spread at that temperature
    (`spread_at[t]`: `seed_spread`'s `pooled_by_temperature`)."""
    exs, va = [_per_prompt(vdir, f) for f in reference], _per_prompt(vdir, variant)
    for f, ex in zip(reference, exs):
        if [(p["dataset"], p["sample_id"]) for p in ex] != [(p["dataset"], p["sample_id"]) for p in va]:
            raise ValueStageError(f"{vdir / variant / 'per_prompt.jsonl'}: not the evaluation prompts of {f}'s")
    out: dict[str, Any] = {"reference": reference[0].split("_seed")[0], "prompts": len(va), "exact_seeds": len(exs)}
    for kind, num, den in KINDS:
        _paired_into(out, kind, [counts_of(ex, num, den) for ex in exs], counts_of(va, num, den), seed)
    by_t: dict[str, Any] = {}
    for t in map(temperature_key, temperatures):
        row: dict[str, Any] = {}
        for kind in ("engine", "offline"):
            _paired_into(row, kind, [counts_at(ex, kind, t) for ex in exs], counts_at(va, kind, t), seed)
        kind = "engine" if row.get("tau_engine") is not None else "offline"
        row["judged"] = _judge(row[f"tau_{kind}"], row[f"tau_{kind}_ci95"], kind, (spread_at or {}).get(t),
                               row.get(f"{kind}_reference_seeds", len(exs)), row)
        row["significant"] = bool(row["judged"]) and row["judged"]["significant"]
        by_t[t] = row
    if by_t:
        out["by_temperature"] = by_t
    ref = _eval_tokens(vdir)
    out["eval_tokens"] = ref
    kind = "engine" if out.get("tau_engine") is not None else "offline"
    est, ci = out[f"tau_{kind}"], out[f"tau_{kind}_ci95"]
    out["judged"] = _judge(est, ci, kind, spread, out.get(f"{kind}_reference_seeds", len(exs)), out)
    out["significant"] = bool(out["judged"]) and out["judged"]["significant"]
    half = (ci[1] - ci[0]) / 2 if ci else None
    out["eval_tokens_to_resolve"] = (None if out["significant"] or not est or not half
                                     else int(ref * (half / abs(est)) ** 2) + 1)
    return out


def diff_to_exact(vdir: Path, variant: str, seed: int = 0, exact_folders: Sequence[str] = ("exact",),
                  spread: dict[str, Any] | None = None, temperatures: Sequence[float] = (),
                  spread_at: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """`diff_to` with exact (its seeds' folders) as the reference."""
    return diff_to(vdir, variant, exact_folders, seed, spread, temperatures, spread_at)


def _eval_tokens(vdir: Path) -> int:
    path = vdir / "reference.jsonl"
    return sum(len(json.loads(x)["output_ids"]) for x in path.read_text(encoding="utf-8").splitlines() if x) \
        if path.exists() else 0


STORAGE_OF = {"int8": ("shards", "int8", "channel_rms"), "fp8": ("speculators", "fp8_e4m3", "token")}


def storage_decision(summary: dict[str, Any]) -> dict[str, Any]:
    """The default `hidden.storage` per layout from the table, by the written rule (MAX_STORAGE_LOSS)."""
    by = {v["variant"]: v for v in summary["variants"]}
    ex = by["exact"]["per_dataset"]
    kind = "engine" if all(f["tau_engine"] is not None for f in ex.values()) else "offline"
    # exact's τ pooled over the evaluation datasets, weighted by their prompts
    tau = sum(f[f"tau_{kind}"] * f["prompts"] for f in ex.values()) / sum(f["prompts"] for f in ex.values())
    limit = round(-MAX_STORAGE_LOSS * tau, 4)
    out: dict[str, Any] = {"rule": f"an 8-bit storage becomes its layout's default only when the lower end of the 95% "
                                   f"interval of its {kind}-τ difference to exact is at least -{MAX_STORAGE_LOSS:.0%} "
                                   f"of exact's τ ({limit}); otherwise bf16 stays",
                           "tau_exact": round(tau, 4), "limit": limit,
                           # a layout whose 8-bit variant did not run is not decided here (None: not measured);
                           # specforge reads bf16 only
                           "default": {"shards": None, "speculators": None, "specforge": "bf16"}}
    rt = by.get("retokenized") or {}
    same = ((rt.get("data") or {}).get("ids_differ_from_exact") or {}).get("differ") == 0
    if same and rt.get("diff_to_exact", {}).get(f"tau_{kind}_ci95"):  # the same ids, states and draft made again
        d = rt["diff_to_exact"]
        out["noise_floor"] = {"by": "retokenized (its ids equal exact's: the same ids through a second 04, other "
                                    "batches, trained in the same order)",
                              "diff": d[f"tau_{kind}"], "ci95": d[f"tau_{kind}_ci95"],
                              "note": "what recomputing the states of the same ids gives; the intervals cover the "
                                      "evaluation prompts, not training's own variance (seed, row order)"}
    for v, (layout, storage, scale) in STORAGE_OF.items():
        d = (by.get(v) or {}).get("diff_to_exact")
        if not d or not d.get(f"tau_{kind}_ci95"):
            out[v] = {"measured": False}
            continue
        free = d[f"tau_{kind}_ci95"][0] >= limit
        out[v] = {"measured": True, "layout": layout, "storage": f"{storage}/{scale}", "diff": d[f"tau_{kind}"],
                  "ci95": d[f"tau_{kind}_ci95"], "free": free}
        out["default"][layout] = storage if free else "bf16"
    # what 04 stores today when `hidden.storage` is not given (params DEFAULT_STORAGE): does it follow this table,
    # on the layouts this table measured? None where it measured no 8-bit storage (a run of other variants)
    out["params_default"] = {layout: default_storage(layout)[0] for layout in out["default"]}
    measured = [layout for layout, _, _ in STORAGE_OF.values() if out["default"][layout] is not None]
    out["params_follow"] = (all(out["params_default"][x] == out["default"][x] for x in out["default"]
                                if out["default"][x] is not None) if measured else None)
    return out



