"""06's table and figures: τ per variant and evaluation set, the per-position acceptance curve, the loss curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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


def position_figure(summary: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for v in summary["variants"]:
        for ds, f in v["per_dataset"].items():
            ks = range(1, len(f["per_position"]) + 1)
            ax.plot(ks, f["per_position"], marker="o", label=f"{v['variant']} · {ds} (offline)")
            if f.get("per_position_engine"):
                ax.plot(ks, f["per_position_engine"], marker="x", linestyle="--", label=f"{v['variant']} · {ds} (engine)")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(first k drafts accepted)")
    ax.set_ylim(0, 1)
    ax.set_xticks(list(ks))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Acceptance by draft position")
    fig.tight_layout()
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
    ax.legend(fontsize=8)
    ax.set_title("Training loss")
    fig.tight_layout()
    return fig
