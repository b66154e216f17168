"""Audit plots (matplotlib): lengths, where the special tokens sit, finish reasons, budget bias.

Each function takes an `AuditResult` (or a table from it) and returns a Figure with a
readable title, axis units and a legend, so it reads the same in JupyterLab and in the
report (where nbconvert embeds it as a PNG). Legends sit outside the plot area (they never
cover data, such as the pile-up at a max_new_tokens cut), and count axes have integer ticks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from eagle3data.audit.checks import FAIL, FLAG


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _finished(fig: Any) -> Any:
    """Close the figure in pyplot and return it: the notebook shows it once, as the cell's value.

    Left open, the inline backend would also flush it at the end of some later cell, which makes
    the number of images a cell shows depend on the kernel (nbval compares it).
    """
    _plt().close(fig)
    return fig


def _outside_legend(ax: Any, **kw: Any) -> None:
    """The axes' legend to the right of the plot area (constrained layout makes room for it)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)


def _integer_ticks(axis: Any) -> None:
    """Counts are whole numbers: no 0.5 record ticks."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _colors(names: list[str]) -> dict[str, Any]:
    cmap = _plt().get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def length_distributions(result: Any) -> Any:
    """Token-length distributions per dataset: prompt, reasoning (reasoning profiles), answer."""
    plt = _plt()
    df = result.lengths()
    parts = ["prompt"] + (["reasoning"] if result.profile.is_reasoning else []) + ["answer"]
    fig, axes = plt.subplots(1, len(parts), figsize=(4.6 * len(parts) + 1.6, 3.6), squeeze=False, layout="constrained")
    datasets = sorted(df["dataset"].unique())
    col = _colors(datasets)
    for ax, part in zip(axes[0], parts):
        vals = [df.loc[df["dataset"] == d, part].dropna().to_numpy() for d in datasets]
        allv = np.concatenate(vals) if vals else np.zeros(0)
        if len(allv) == 0:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        else:
            hi = max(1.0, float(allv.max()))
            bins = np.linspace(0, hi, 30)
            for d, v in zip(datasets, vals):
                if len(v):
                    ax.hist(v, bins=bins, histtype="step", linewidth=1.6, color=col[d], label=f"{d} (n={len(v)})")
        ax.set_title(f"{part} length")
        ax.set_xlabel("tokens")
        ax.set_ylabel("records")
        _integer_ticks(ax.yaxis)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=7, loc="outside right upper")
    fig.suptitle("Token lengths per dataset")
    return _finished(fig)


def special_positions(result: Any) -> Any:
    """Where the special tokens sit: reasoning-close and end-of-turn position against output length.

    Points on the diagonal end the output; tool-call sections are drawn as vertical bars
    from their begin to end position; failing records are circled in red.
    """
    plt = _plt()
    df = result.lengths()
    fig, ax = plt.subplots(figsize=(9.5, 4.6), layout="constrained")
    datasets = sorted(df["dataset"].unique())
    col = _colors(datasets)
    L = df["output"].to_numpy()
    hi = max(1, int(L.max()) if len(L) else 1)
    ax.plot([0, hi], [0, hi], color="0.8", linewidth=1, zorder=0, label="output end (y = length)")
    for d in datasets:
        s = df[df["dataset"] == d]
        ax.scatter(s["output"], s["eot_pos"], marker="s", s=14, color=col[d], alpha=0.8, label=f"{d}: end-of-turn")
        if result.profile.is_reasoning:
            ax.scatter(s["output"], s["close_pos"], marker="^", s=18, facecolors="none", edgecolors=col[d],
                       label=f"{d}: reasoning-close")
    sec = result.positions.tool_sections
    if len(sec):
        Lrec = result.table.output_len
        x = Lrec[sec["record"].to_numpy()]
        ax.vlines(x, sec["begin"], sec["end"], color="black", linewidth=2.5, label="tool-call section")
    failed = (result.status.to_numpy() == 1).any(axis=1)[result.table.has_output]
    if failed.any():
        f = df[failed]
        ax.scatter(f["output"], f["eot_pos"].fillna(f["output"]), s=90, facecolors="none", edgecolors="red",
                   linewidths=1.5, label="record with a failed check")
    ax.set_xlabel("output length (tokens)")
    ax.set_ylabel("position in the output (token index)")
    ax.set_title("Where the special tokens sit in each output")
    _integer_ticks(ax.xaxis)
    _integer_ticks(ax.yaxis)
    _outside_legend(ax, fontsize=7)
    return _finished(fig)


def finish_reasons(result: Any) -> Any:
    """Finish reasons per dataset (stacked bars: stop, length, abort, error)."""
    plt = _plt()
    m = result.meta
    tab = pd.crosstab(m["dataset"], m["finish_reason"])
    order = [c for c in ("stop", "length", "abort", "error") if c in tab.columns] + \
        [c for c in tab.columns if c not in ("stop", "length", "abort", "error")]
    tab = tab[order]
    colors = {"stop": "tab:green", "length": "tab:orange", "abort": "tab:purple", "error": "tab:red"}
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(tab) + 1.8), layout="constrained")
    left = np.zeros(len(tab))
    for c in tab.columns:
        ax.barh(tab.index, tab[c], left=left, color=colors.get(c, "0.5"), label=c)
        left += tab[c].to_numpy()
    ax.set_xlabel("records")
    _integer_ticks(ax.xaxis)
    ax.set_title("Finish reasons per dataset (length = truncated, not broken)")
    _outside_legend(ax, title="finish_reason", fontsize=8)
    ax.invert_yaxis()
    return _finished(fig)


def prompt_length_bias(groups: pd.DataFrame | None) -> Any:
    """Prompt lengths of done vs. skipped vs. cancelled samples: a biased budget cut shows here."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.0, 3.4), layout="constrained")
    if groups is None or len(groups) == 0:
        ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes)
    else:
        colors = {"done": "tab:blue", "skipped": "tab:orange", "cancelled": "tab:red"}
        hi = max(1.0, float(groups["prompt_tokens"].max()))
        bins = np.linspace(0, hi, 30)
        for g, s in groups.groupby("group"):
            ax.hist(s["prompt_tokens"], bins=bins, histtype="step", linewidth=1.8, density=True,
                    color=colors.get(g, "0.4"), label=f"{g} (n={len(s)}, median {s['prompt_tokens'].median():.0f})")
        if set(groups["group"]) == {"done"}:
            ax.set_title("Prompt lengths of done samples (nothing skipped or cancelled)")
        else:
            ax.set_title("Prompt lengths: done vs. skipped vs. cancelled")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("share of samples (density)")
    _outside_legend(ax, fontsize=8)
    return _finished(fig)


def check_failures(result: Any) -> Any:
    """Failed and flagged records per check and dataset (only checks that failed or flagged somewhere; a clean run
    says so). A flagging check (audit.flag_only) is labelled `(flag, kept)`: its records stay in the mix."""
    plt = _plt()
    st = result.status
    hit = np.isin(st.to_numpy(), (FAIL, FLAG))
    flags = (st.to_numpy() == FLAG).any(axis=0)
    names = [f"{c} (flag, kept)" if f else c for c, f in zip(st.columns, flags)]
    df = pd.DataFrame(hit, columns=names)
    df["dataset"] = result.meta["dataset"].astype(str).to_numpy()
    tab = df.groupby("dataset").sum()
    tab = tab.loc[:, tab.sum() > 0]
    fig, ax = plt.subplots(figsize=(8.5, 0.5 * max(1, tab.shape[1]) + 2.0), layout="constrained")
    if tab.shape[1] == 0:
        ax.text(0.5, 0.5, f"no check failed on {len(st)} records", ha="center", va="center",
                transform=ax.transAxes, fontsize=12)
        ax.set_axis_off()
    else:
        tab.T.plot.barh(stacked=True, ax=ax)
        ax.set_xlabel("failed (or flagged) records")
        _integer_ticks(ax.xaxis)
        _outside_legend(ax, title="dataset", fontsize=7)
    ax.set_title("Failed and flagged records per check")
    return _finished(fig)
