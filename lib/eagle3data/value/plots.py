"""06's table and figures: τ per variant and evaluation set, the per-position acceptance curve, the loss curve;
`save_figures` writes them beside the summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3data.audit.report import render_report
from eagle3data.core.atomic import write_atomic


def tau_table(summary: dict[str, Any]) -> Any:
    import pandas as pd

    rows = []
    for v in summary["variants"]:
        for ds, f in v["per_dataset"].items():
            ci_e, ci_o = f.get("tau_engine_ci95") or [None, None], f.get("tau_offline_ci95") or [None, None]
            rows.append({"variant": v["variant"], "evaluation set": ds, "prompts": f["prompts"],
                         "τ engine": f["tau_engine"], "engine 95%": f"{ci_e[0]}–{ci_e[1]}" if ci_e[0] else "",
                         "τ offline": f["tau_offline"], "offline 95%": f"{ci_o[0]}–{ci_o[1]}" if ci_o[0] else "",
                         "per position (offline)": " / ".join(f"{x:.0%}" for x in f["per_position"] if x is not None),
                         "lossless": f["lossless"], "train tokens": v["train_tokens"], "train s": v["seconds"]})
    return pd.DataFrame(rows)


def diff_table(summary: dict[str, Any]) -> Any:
    """Each variant against exact: Δτ paired over the same prompts, pooled over the evaluation sets, with intervals."""
    import pandas as pd

    rows = []
    for v in summary["variants"]:
        d = v.get("diff_to_exact")
        if not d:
            continue
        ce, co = d.get("tau_engine_ci95") or [None, None], d.get("tau_offline_ci95") or [None, None]
        vh = v.get("verify_hidden") or {}
        rows.append({"variant": v["variant"], "its data": v.get("about"),
                     "Δτ engine": d.get("tau_engine"), "engine 95%": f"{ce[0]}–{ce[1]}" if ce[0] is not None else "",
                     "Δτ offline": d.get("tau_offline"), "offline 95%": f"{co[0]}–{co[1]}" if co[0] is not None else "",
                     "significant": d.get("significant"), "eval tokens to resolve": d.get("eval_tokens_to_resolve"),
                     "verify-hidden exit": vh.get("exit")})
    return pd.DataFrame(rows)


def _ci_text(ci: Any) -> str:
    return f"{ci[0]}–{ci[1]}" if ci and ci[0] is not None else ""


def temperature_table(summary: dict[str, Any]) -> Any:
    """τ per variant, evaluation set and sampling temperature (`eval.temperatures`), with 95% intervals over prompts:
    offline (vLLM's greedy drafts against the target's tempered distribution, sampling.py; `along`: the target's
    continuations it is taken along, greedy or sampled at T) and, where the engine served the variant at that
    temperature, the engine's (its rejection sampler, seeded requests)."""
    import pandas as pd

    rows = []
    for v in summary["variants"]:
        for ds, f in v["per_dataset"].items():
            eng = f.get("engine_by_temperature") or {}
            for t, x in (f.get("offline_by_temperature") or {}).items():
                e = eng.get(t) or {}
                rows.append({"variant": v["variant"], "evaluation set": ds, "T": float(t),
                             "τ engine": e.get("tau"), "engine 95%": _ci_text(e.get("tau_ci95")),
                             "τ offline": x["tau"], "offline 95%": _ci_text(x.get("tau_ci95")),
                             "offline along": x.get("along", "greedy"),
                             "per position (offline)": " / ".join(f"{p:.0%}" for p in x["per_position"]
                                                                  if p is not None)})
    return pd.DataFrame(rows)


def _diffs(v: dict[str, Any]) -> list[dict[str, Any]]:
    """A variant's Δτ records: to exact, and to the variant it was made from (`diff_to`), each with its reference."""
    return [d | {"reference": d.get("reference") or "exact"} for d in (v.get("diff_to_exact"), v.get("diff_to")) if d]


def diff_temperature_table(summary: dict[str, Any]) -> Any:
    """Each variant against its references per sampling temperature: Δτ paired over the same prompts, engine (where
    both sides were served at T) and offline, 95% intervals (sampled against exact: what regenerating sampled is worth
    at the temperature one serves)."""
    import pandas as pd

    rows = []
    for v in summary["variants"]:
        for d in _diffs(v):
            for t, x in (d.get("by_temperature") or {}).items():
                rows.append({"variant": v["variant"], "against": d["reference"], "T": float(t),
                             "Δτ engine": x.get("tau_engine"), "engine 95%": _ci_text(x.get("tau_engine_ci95")),
                             "Δτ offline": x.get("tau_offline"), "offline 95%": _ci_text(x.get("tau_offline_ci95"))})
    return pd.DataFrame(rows)


def size_figure(summary: dict[str, Any]) -> Any:  # None without a size curve
    """τ against training tokens (log axis) over the data-size points, the fitted line, and the slope per doubling
    with its interval."""
    import matplotlib.pyplot as plt
    import numpy as np

    sl = summary.get("size_slope")
    if not sl:
        return None
    x = np.asarray([p["tokens"] for p in sl["points"]], dtype=float)
    y = [p["tau"] for p in sl["points"]]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(x, y, "o", color="C0")
    for xi, yi, n in zip(x, y, sl["variants"]):
        ax.annotate(n, (xi, yi), textcoords="offset points", xytext=(4, -10), fontsize=8)
    xs = np.geomspace(x.min(), x.max(), 50)
    ax.plot(xs, sl["intercept"] + sl["slope_per_doubling"] * np.log2(xs), color="C0", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training tokens (log scale)")
    ax.set_ylabel(f"τ ({sl['tau']}, pooled)")
    ci = sl["ci95"]
    ax.set_title(f"τ per doubling of data: {sl['slope_per_doubling']:+.3f} (95% {ci[0]:+.3f} to {ci[1]:+.3f})",
                 fontsize=10)
    fig.tight_layout()
    plt.close(fig)  # shown once, as the cell's value
    return fig


def seed_table(summary: dict[str, Any]) -> Any:
    """exact's τ over its training seeds per evaluation set (and pooled), engine and offline: mean, sd, min–max."""
    import pandas as pd

    sp = summary.get("seed_spread") or {}
    rows = []
    for ds, kinds in list((sp.get("per_dataset") or {}).items()) + ([("(pooled)", sp["pooled"])] if sp else []):
        for kind, x in kinds.items():
            if x["seeds"]:
                rows.append({"evaluation set": ds, "τ": kind, "seeds": x["seeds"], "mean": x["mean"], "sd": x["sd"],
                             "min": x["min"], "max": x["max"]})
    return pd.DataFrame(rows)


def online_table(summary: dict[str, Any]) -> Any:
    """The `online` variant's states as generated while it trained: the server, its round trips (every reply's echoed
    ids checked by speculators), and the generated states against 04's store of the same key (verify-hidden's
    recompute tolerance; `worst max_rel`: the largest element error over its row's RMS, per state)."""
    import pandas as pd

    rows = []
    for v in summary["variants"]:
        on = v.get("online")
        if not on:
            continue
        st = on["store_check"]
        rows.append({"variant": v["variant"], "connector": (on.get("server") or {}).get("connector"),
                     "rows generated": on["rows_generated"], "requests": on["requests"],
                     "echoed ids equal": on["echoed_ids_equal"], "failed": on["failed_requests"],
                     "generate s": on["generate_s"], "vs store: rows": st["rows"], "ids equal": st["ids_equal"],
                     "beyond tolerance": st["failed"],
                     "worst max_rel": ", ".join(f"{k} {x:.3g}" for k, x in st["worst_max_rel"].items())})
    return pd.DataFrame(rows)


def diff_figure(summary: dict[str, Any]) -> Any:  # None when only exact ran
    """Δτ to exact per variant with its 95% interval (engine where measured, else offline); 0 is exact."""
    import matplotlib.pyplot as plt

    vs = [v for v in summary["variants"] if v.get("diff_to_exact")]
    if not vs:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(vs) + 1.2))
    for i, v in enumerate(vs):
        d = v["diff_to_exact"]
        kind = "engine" if d.get("tau_engine") is not None else "offline"
        est, ci = d[f"tau_{kind}"], d[f"tau_{kind}_ci95"]
        if est is None:
            continue
        ax.errorbar([est], [i], xerr=[[est - ci[0]], [ci[1] - est]], fmt="o", capsize=3,
                    color="C3" if d.get("significant") and est < 0 else "C0")
    ax.axvline(0, color="grey", linewidth=1)
    ax.set_yticks(range(len(vs)), [v["variant"] for v in vs])
    ax.invert_yaxis()
    ax.set_xlabel("τ(variant) − τ(exact), 95% interval, paired over prompts")
    ax.set_title("What each guarantee is worth")
    fig.tight_layout()
    plt.close(fig)  # shown once, as the cell's value (not again by the inline backend)
    return fig


def position_figure(summary: dict[str, Any]) -> Any:
    """P(first k drafts accepted) per variant, one panel per evaluation set (engine where measured, else offline)."""
    import matplotlib.pyplot as plt

    sets = list(summary["variants"][0]["per_dataset"])
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets) + 1.8, 3.4), squeeze=False, sharey=True)
    for ax, ds in zip(axes[0], sets):
        for v in summary["variants"]:
            f = v["per_dataset"].get(ds)
            if not f:
                continue
            pos, kind = (f["per_position_engine"], "engine") if f.get("per_position_engine") else (f["per_position"], "offline")
            ks = list(range(1, len(pos) + 1))
            ax.plot(ks, pos, marker="o", label=v["variant"])
            ax.set_xticks(ks)
        ax.set_title(f"{ds} ({kind})", fontsize=9)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("P(first k drafts accepted)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle("Acceptance by draft position", fontsize=10)
    fig.tight_layout()
    plt.close(fig)  # shown once, as the cell's value (not again by the inline backend)
    return fig


def loss_figure(run_dir: Path, summary: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for v in summary["variants"]:
        log = Path(run_dir) / "value" / v["variant"] / "train_log.jsonl"
        rows = [json.loads(x) for x in log.read_text(encoding="utf-8").splitlines() if x.strip()] if log.exists() else []
        if rows:
            ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], label=v["variant"], linewidth=1)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (speculators' kl_div, summed over TTT steps)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.set_title("Training loss")
    fig.tight_layout()
    plt.close(fig)  # shown once, as the cell's value (not again by the inline backend)
    return fig


def summary_markdown(summary: dict[str, Any]) -> str:
    """The table as docs/06 shows it (markdown): τ per variant and evaluation set, then each variant against exact."""

    def ci(c: Any, digits: int = 2) -> str:
        return f"({c[0]:.{digits}f}–{c[1]:.{digits}f})" if c else ""

    out = ["| variant | evaluation set | prompts | τ engine (95%) | τ offline (95%) | per position, engine | lossless |",
           "|---|---|---|---|---|---|---|"]
    for v in summary["variants"]:
        for ds, f in v["per_dataset"].items():
            pos = " / ".join(f"{x:.1%}" for x in (f.get("per_position_engine") or f["per_position"]) if x is not None)
            te = f"**{f['tau_engine']:.3f}** {ci(f['tau_engine_ci95'])}" if f["tau_engine"] is not None else "–"
            out.append(f"| {v['variant']} | {ds} | {f['prompts']} | {te} | {f['tau_offline']:.3f} "
                       f"{ci(f['tau_offline_ci95'])} | {pos} | {f['lossless']} |")
    diffs = [v for v in summary["variants"] if v.get("diff_to_exact")]
    if diffs:
        out += ["", "| variant | Δτ engine (95%) | Δτ offline (95%) | significant | eval tokens to resolve | "
                    "verify-hidden | train tokens |", "|---|---|---|---|---|---|---|"]
        for v in diffs:
            d = v["diff_to_exact"]
            vh = v.get("verify_hidden") or {}
            ver = (f"exit {vh['exit']}: {vh.get('failed_samples')} of {vh.get('samples')} failed" if "exit" in vh
                   else "passed" if vh.get("ok") else "")
            if v.get("online"):  # no stored state to verify: the generated ones against 04's store instead
                st = v["online"]["store_check"]
                ver = (f"online: ids {v['online']['echoed_ids_equal']:,} echoed equal; states vs 04's store "
                       f"{st['rows'] - st['failed']:,} of {st['rows']:,} within tolerance")
            te = f"**{d['tau_engine']:+.3f}** {ci(d['tau_engine_ci95'], 3)}" if d.get("tau_engine") is not None else "–"
            to = f"{d['tau_offline']:+.3f} {ci(d['tau_offline_ci95'], 3)}" if d.get("tau_offline") is not None else "–"
            res = f"{d['eval_tokens_to_resolve']:,}" if d.get("eval_tokens_to_resolve") else ""
            out.append(f"| {v['variant']} | {te} | {to} | {'yes' if d['significant'] else 'no'} | {res} | {ver} | "
                       f"{v['train_tokens']:,} |")
    temps = [t for t in (summary.get("eval") or {}).get("temperatures") or [0.0] if t]
    if temps:  # τ at the sampling temperatures (T = 0 is the table above), engine where it served them
        def cell(x: Any) -> str:
            return f"{x['tau']:.3f} {ci(x['tau_ci95'])}" if x and x.get("tau") is not None else "–"

        out += ["", "| variant | evaluation set | " + " | ".join(f"τ engine T={t:g} (95%) | τ offline T={t:g} (95%)"
                                                             for t in temps) + " |",
                "|---|---|" + "---|---|" * len(temps)]
        for v in summary["variants"]:
            for ds, f in v["per_dataset"].items():
                off, eng = f.get("offline_by_temperature") or {}, f.get("engine_by_temperature") or {}
                cells = [f"{cell(eng.get(str(float(t))))} | {cell(off.get(str(float(t))))}" for t in temps]
                out.append(f"| {v['variant']} | {ds} | " + " | ".join(cells) + " |")
        rows = [(v["variant"], d["reference"], t, x) for v in summary["variants"] for d in _diffs(v)
                for t, x in (d.get("by_temperature") or {}).items()]
        if rows:
            def dcell(x: Any, kind: str) -> str:
                e = x.get(f"tau_{kind}")
                return f"{e:+.3f} {ci(x.get(f'tau_{kind}_ci95'), 3)}" if e is not None else "–"

            def jcell(x: Any) -> str:  # the difference judged against evaluation and seed noise at that T
                j = x.get("judged")
                return (f"{ci(j['ci95'], 3)} ({', '.join(j['judged_against'])}) | "
                        f"{'yes' if j['significant'] else 'no'}") if j else "– | –"

            out += ["", "| variant | against | T | Δτ engine (95%) | Δτ offline (95%) | judged (95%) | significant |",
                    "|---|---|---|---|---|---|---|"]
            out += [f"| {n} | {r} | {float(t):g} | {dcell(x, 'engine')} | {dcell(x, 'offline')} | {jcell(x)} |"
                    for n, r, t, x in rows]
    sp = summary.get("seed_spread")
    if sp:  # exact over its training seeds, and each difference judged against evaluation and seed noise
        out += ["", f"exact over seeds {sp['seeds']}:", "", "| evaluation set | τ | mean | sd | min–max |",
                "|---|---|---|---|---|"]
        for ds, kinds in list(sp["per_dataset"].items()) + [("(pooled)", sp["pooled"])]:
            out += [f"| {ds} | {k} | {x['mean']:.3f} | {x['sd']} | {x['min']:.3f}–{x['max']:.3f} |"
                    for k, x in kinds.items() if x["seeds"]]
        judged = [(v["variant"], v["diff_to_exact"]["judged"]) for v in diffs if v["diff_to_exact"].get("judged")]
        if judged:
            out += ["", "| variant | Δτ | 95%, evaluation and seeds | significant |", "|---|---|---|---|"]
            out += [f"| {n} | {j['diff']:+.3f} | {ci(j['ci95'], 3)} | {'yes' if j['significant'] else 'no'} |"
                    for n, j in judged]
    sl = summary.get("size_slope")
    if sl:
        fit = f"; fit {ci(sl['ci95_fit'], 3)}" if sl.get("ci95_fit") else ""
        out += ["", f"τ per doubling of training tokens ({sl['tau']}, {', '.join(sl['variants'])}): "
                    f"{sl['slope_per_doubling']:+.3f} {ci(sl['ci95'], 3)}{fit}; points "
                    + ", ".join(f"{p['tokens']:,} tokens τ {p['tau']:.3f}" for p in sl["points"])]
    return "\n".join(out)


def save_figures(run_dir: Path, summary: dict[str, Any]) -> None:
    """The table as markdown (`summary.md`, as docs/06 shows it) and the curves as PNG beside the summary, and the
    run's report.html re-rendered with 06's section."""
    import matplotlib.pyplot as plt

    write_atomic(run_dir / "value" / "summary.md", (summary_markdown(summary) + "\n").encode())
    figs = [("tau_positions.png", position_figure(summary)), ("train_loss.png", loss_figure(run_dir, summary))]
    if any(v.get("diff_to_exact") for v in summary["variants"]):
        figs.append(("tau_diff.png", diff_figure(summary)))
    if summary.get("size_slope"):
        figs.append(("tau_size.png", size_figure(summary)))
    for name, fig in figs:
        fig.savefig(run_dir / "value" / name, dpi=90, bbox_inches="tight")
        plt.close(fig)
    if (run_dir / "notebooks" / "03_audit.ipynb").exists():
        render_report(run_dir)
