"""HTML rendering: executed notebooks as HTML, and the run's shareable `report.html`.

The report opens on the run's summary across the stages that ran (`overview`), then the executed
03_audit notebook rendered without code cells and without its notebook-only notes (cells tagged
`notebook-only`: what it reads and writes, its parameters), then 04's verification and 06's τ when
they ran: images are embedded (nbconvert's HTML exporter inlines PNG outputs), so the file stands alone.
"""

from __future__ import annotations

import re
from html import escape as html_escape
from pathlib import Path
from typing import Any
from eagle3data.audit.checks import CHECK_NAMES, iter_checks
from eagle3data.audit.overview import VALUE_ID, VERIFY_ID, hidden_dir_of, summary_html
from eagle3data.core.params import params_for_display, repo_root
from eagle3data.core.params.hidden import storage_default_text
from eagle3data.core.stats import upper95_text

# Cells with this tag run and keep their outputs in the executed notebook (nbval compares them; the
# "figures recorded for tests" cells carry it) but are left out of every HTML rendering.
HIDE_TAG = "hide-from-html"
# Markdown cells with this tag (a stage's Reads / Writes / Parameters notes) stay in the notebook and its HTML
# copy, and out of the shared report.html.
NOTEBOOK_ONLY_TAG = "notebook-only"
EXTERNAL_SCRIPT = re.compile(r"<script[^>]*\bsrc=\"https?://[^\"]*\"[^>]*>\s*</script>", re.I)
SECRET_KEY = re.compile(r"(api_?key|secret|token|password|authorization)(?!_env)", re.I)


def notebook_to_html(nb_path: str | Path, html_path: str | Path, *, exclude_input: bool = False,
                     remove_tags: frozenset[str] = frozenset()) -> Path:
    """Render an executed notebook to a self-contained HTML file (cells tagged `hide-from-html`, and any of
    `remove_tags`, left out)."""
    import nbformat
    from nbconvert import HTMLExporter

    from nbconvert.preprocessors import TagRemovePreprocessor

    nb = nbformat.read(str(nb_path), as_version=4)
    exporter = HTMLExporter(exclude_input=exclude_input, exclude_input_prompt=exclude_input,
                            exclude_output_prompt=exclude_input)
    exporter.register_preprocessor(TagRemovePreprocessor(remove_cell_tags={HIDE_TAG, *remove_tags}, enabled=True),
                                   enabled=True)
    body, _ = exporter.from_notebook_node(nb)
    Path(html_path).write_text(body, encoding="utf-8")
    return Path(html_path)


def render_report(run_dir: str | Path) -> Path:
    """`<run>/report.html`: the run's summary, then the executed 03_audit notebook (code cells and notebook-only
    notes left out), 04's verification and 06's τ when they ran."""
    run_dir = Path(run_dir)
    src = run_dir / "notebooks" / "03_audit.ipynb"
    if not src.exists():
        raise FileNotFoundError(f"no executed audit notebook at {src}: run stage 03 first")
    out = notebook_to_html(src, run_dir / "report.html", exclude_input=True, remove_tags=frozenset({NOTEBOOK_ONLY_TAG}))
    text = out.read_text(encoding="utf-8")
    # self-contained: drop the template's CDN scripts (require.js, MathJax); the report needs neither
    text = EXTERNAL_SCRIPT.sub("", text)
    section = verification_html(_verify_summary(run_dir))
    if section:  # 04's verification (verify-hidden's summary), after the audit
        text = text.replace("</body>", f'<div class="e3-verify" id="{VERIFY_ID}" style="margin:1em 2em">{section}'
                            "</div></body>", 1)
    value = value_html(run_dir)
    if value:  # 06: the drafter's acceptance length, when the stage ran
        text = text.replace("</body>", f'<div class="e3-value" id="{VALUE_ID}" style="margin:1em 2em">{value}'
                            "</div></body>", 1)
    # the run's summary opens the page, above the first notebook cell, linking to the sections below
    top = summary_html(run_dir, text)
    text = re.sub(r"<title>.*?</title>", f"<title>{html_escape(run_dir.name)} · report</title>", text, count=1, flags=re.S)
    m = re.search(r"<main[^>]*>", text) or re.search(r"<body[^>]*>", text)
    text = text[:m.end()] + top + text[m.end():] if m else top + text
    out.write_text(text, encoding="utf-8")
    return out


def value_html(run_dir: Path) -> str:
    """The report's section on stage 06 (`value/summary.json` and the figures it saved): τ per variant and
    evaluation set with intervals, the per-position acceptance curve and the training loss curve."""
    import base64
    import html
    import json

    path = Path(run_dir) / "value" / "summary.json"
    if not path.exists():
        return ""
    s = json.loads(path.read_text(encoding="utf-8"))
    k = s["eval"]["num_speculative_tokens"]
    rows = []
    for v in s["variants"]:
        for ds, f in v["per_dataset"].items():
            ci = f.get("tau_engine_ci95") or ["", ""]
            co = f.get("tau_offline_ci95") or ["", ""]
            pos = " / ".join(f"{x:.0%}" for x in f.get("per_position") or [] if x is not None)
            rows.append(f"<tr><td>{html.escape(v['variant'])}</td><td>{html.escape(ds)}</td><td>{f['prompts']}</td>"
                        f"<td><b>{f['tau_engine']}</b> ({ci[0]}–{ci[1]})</td><td>{f['tau_offline']} ({co[0]}–{co[1]})"
                        f"</td><td>{pos}</td><td>{f['lossless']}</td></tr>")
    imgs = "".join(f'<img style="max-width:48%" alt="{n}" src="data:image/png;base64,'
                   f'{base64.b64encode((path.parent / n).read_bytes()).decode()}">'
                   for n in ("tau_diff.png", "tau_positions.png", "train_loss.png", "tau_size.png")
                   if (path.parent / n).exists())
    diffs = []
    for v in s["variants"]:
        d = v.get("diff_to_exact")
        if not d:
            continue
        de, do = d.get("tau_engine_ci95") or ["", ""], d.get("tau_offline_ci95") or ["", ""]
        note = ("significant" if d.get("significant") else
                f"not significant; ~{d['eval_tokens_to_resolve']:,} eval tokens would resolve it"
                if d.get("eval_tokens_to_resolve") else "not significant")
        vh = v.get("verify_hidden") or {}
        if "exit" in vh:
            note += f"; verify-hidden exit {vh['exit']} ({vh.get('failed_samples')} of {vh.get('samples')} failed)"
        diffs.append(f"<tr><td>{html.escape(v['variant'])}</td><td>{html.escape(v.get('about') or '')}</td>"
                     f"<td><b>{d.get('tau_engine')}</b> ({de[0]}–{de[1]})</td><td>{d.get('tau_offline')} "
                     f"({do[0]}–{do[1]})</td><td>{html.escape(note)}</td></tr>")
    ablation = ""
    if diffs:
        ablation = ("<h3>Each variant against exact</h3><p>τ(variant) − τ(exact), paired over the same evaluation "
                    "prompts and pooled over the evaluation sets, 95% bootstrap intervals; every draft trained with "
                    "the same budget, seed and config.</p><table><tr><th>variant</th><th>its data</th>"
                    f"<th>Δτ engine (95%)</th><th>Δτ offline (95%)</th><th></th></tr>{''.join(diffs)}</table>")
    sd = s.get("storage_decision")
    if sd:
        ablation += (f"<p><b>Storage default</b> by layout: {html.escape(storage_default_text(sd['default']))}"
                     f". Rule: {html.escape(sd['rule'])}."
                     + (f" 04's default when <code>hidden.storage</code> is not given: "
                        f"{html.escape(', '.join(f'{k} {v}' for k, v in sd['params_default'].items()))}"
                        + (" (no 8-bit variant ran: not checked)" if sd.get("params_follow") is None
                           else "" if sd.get("params_follow") else " (differs from this table's decision)")
                        if "params_default" in sd else "") + "</p>")
    return (f"<h2>06 · What the data is worth</h2><p>A draft trained on this run's hand-off; acceptance length τ "
            f"(tokens per verification step, the bonus token included) with k = {k} drafts, greedy, 95% intervals "
            "over prompts. Engine: vLLM's speculative decoding (lossless: its ids equal plain greedy ids). Offline: "
            "every output position as an anchor, from the target's own states.</p>"
            "<table><tr><th>variant</th><th>evaluation set</th><th>prompts</th><th>τ engine (95%)</th>"
            f"<th>τ offline (95%)</th><th>per position</th><th>lossless</th></tr>{''.join(rows)}</table>{ablation}{imgs}")


def _verify_summary(run_dir: Path) -> dict[str, Any] | None:
    """verify-hidden's summary of the run's store (`<hidden dir>/verify_summary.json`), if it ran."""
    import orjson

    path = hidden_dir_of(run_dir) / "verify_summary.json"
    return orjson.loads(path.read_bytes()) if path.exists() else None


def verification_html(summary: dict[str, Any] | None) -> str:
    """The report's section on 04's stored states: verify-hidden's verdict and its per-check table with bounds."""
    import html

    if summary is None:
        return ""
    s = summary
    run_failed = [p["check"] for p in s.get("store_problems") or []]
    title = (f"No stored sample failed verification ({s['samples']} samples, {s['tokens']:,} tokens)" if s["ok"]
             else f"{s['failed_samples']} of {s['samples']} stored samples failed verification"
             + (f"; the run failed {', '.join(run_failed)}" if run_failed else ""))
    rows = []
    for name, c in s["checks"].items():
        bound = upper95_text(c)
        style = ' style="color:#cf222e;font-weight:bold"' if c["failed"] else ""
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{c['applicable']}</td><td{style}>{c['failed']}</td>"
                    f"<td>{bound}</td><td>{html.escape(c['what'])}</td></tr>")
    table = ('<table class="verify-table" border="0"><thead><tr><th>check</th><th>applicable</th><th>failed</th>'
             "<th>upper95</th><th>what it proves</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")
    head = s.get("head") or {}
    at = (f"logit z at {head['out_mean']:g} output + {head['prompt_mean']:g} prompt positions per sample (at most "
          f"{s['positions']}), the whole head at {head.get('exact_positions', 0)} output positions over the run"
          + (f" (greedy top-1 {head['pooled_greedy_top1']:.1%})" if head.get("pooled_greedy_top1") is not None else "")
          if head else f"{s['positions']} output and prompt positions per sample")
    note = (f"Head: {at}; {s['recomputed']} sample(s) "
            f"recomputed through the target; norm profile {s['norm_profile']}; states {', '.join(s['states'])} "
            f"({s['dtype']}, layout {s['layout']}). upper95: 95% upper bound on the failure rate (rule of three "
            "at zero failures).")
    return ("<h2>Hidden states (04): verification</h2>"
            + banner("ok" if s["ok"] else "error", title).html + table
            + f'<p style="font-size:12px;color:#555">{html.escape(note)}</p>')


def redact(obj: Any) -> Any:
    """Params as plain data with any secret-looking value replaced (params hold none by design)."""
    if isinstance(obj, dict):
        return {k: ("***" if SECRET_KEY.search(str(k)) and not str(k).endswith("_env") and isinstance(v, str)
                    else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


class HTMLBlock:
    """A piece of HTML that Jupyter (and so the report) displays as is."""

    def __init__(self, html: str):
        self.html = html

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:  # the text/plain twin of the HTML: stable, so nbval compares only the HTML
        return "<HTML block>"


def show_table(df: Any, css_class: str = "audit-table", *, caption: str | None = None) -> HTMLBlock:
    """A DataFrame as an HTML table with a CSS class (the report's check table is `check-table`)."""
    if df is None or len(df) == 0:
        return HTMLBlock(f"<p><i>{caption or 'table'}: nothing to show</i></p>")
    body = df.to_html(classes=css_class, na_rep="", float_format=lambda x: f"{x:.4g}", border=0)
    cap = f"<p><b>{caption}</b></p>" if caption else ""
    return HTMLBlock(cap + body)


def shown_path(path: Any, base: str | Path | None = None) -> str:
    """A path as a report shows it: relative to `base` (the run folder) or the checkout, never the machine's root.

    Outside both, an absolute path keeps only its last two parts (`…/runs/myrun`).
    """
    p = Path(str(path))
    if not p.is_absolute():
        return str(p)
    for root in ([Path(base)] if base is not None else []) + [repo_root()]:
        try:
            rel = p.resolve().relative_to(Path(root).resolve())
            return str(rel) if str(rel) != "." else (p.name or str(p))
        except ValueError:
            continue
    return str(Path("…", *p.parts[-2:]))


def _relative_paths(obj: Any) -> Any:
    """Absolute paths under the checkout as relative ones, in plain data (the params for display)."""
    if isinstance(obj, dict):
        return {k: _relative_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_relative_paths(v) for v in obj]
    if isinstance(obj, str) and obj.startswith("/") and "\n" not in obj:
        return shown_path(obj)
    return obj


def params_html(params: Any) -> HTMLBlock:
    """The run's params as an indented YAML block (secrets redacted, paths relative to the checkout)."""
    import html

    import yaml


    text = yaml.safe_dump(_relative_paths(redact(params_for_display(params))), sort_keys=False, allow_unicode=True)
    return HTMLBlock(f'<pre style="font-size:12px;background:#f6f8fa;padding:6px;max-height:22em;overflow:auto">{html.escape(text)}</pre>')


# ------------------------------------------------------------------ banners

_BANNER = {"warning": "background:#fff8c5;border:1px solid #d4a72c;color:#4d2d00",
           "error": "background:#ffebe9;border:1px solid #cf222e;color:#82071e",
           "ok": "background:#dafbe1;border:1px solid #1a7f37;color:#044f1e"}


def banner(level: str, title: str, lines: list[str] | None = None) -> HTMLBlock:
    """A coloured box at the top of a notebook / report: `warning`, `error` or `ok`, with detail lines."""
    import html

    items = "".join(f"<li>{html.escape(str(x))}</li>" for x in (lines or []))
    return HTMLBlock(f'<div class="e3-banner e3-banner-{level}" style="{_BANNER[level]};border-radius:6px;'
                     f'padding:8px 12px;margin:6px 0"><b>{html.escape(title)}</b>'
                     + (f'<ul style="margin:4px 0 0 0">{items}</ul>' if items else "") + "</div>")


def banners(blocks: list[HTMLBlock]) -> HTMLBlock:
    """Several banners as one output (nothing when the list is empty)."""
    return HTMLBlock("".join(b.html for b in blocks))


def rejected_prompt_lines(ledger: dict[str, Any] | None, k: int = 3) -> dict[str, tuple[int, list[str]]]:
    """Per dataset of the ledger: (how many prompt lines were rejected, the first k of them)."""
    out = {}
    for name, d in ((ledger or {}).get("datasets") or {}).items():
        rej = list((d or {}).get("rejected_prompt_lines") or [])
        if rej:
            out[name] = (len(rej), [str(x) for x in rej[:k]])
    return out


def ledger_banners(ledger: dict[str, Any] | None, records: int | None = None) -> list[HTMLBlock]:
    """Warnings from 01's ledger: zero records, prompt lines rejected when the datasets were read."""
    out = []
    datasets = (ledger or {}).get("datasets") or {}
    done = records if records is not None else sum(int((d or {}).get("done") or 0) for d in datasets.values())
    if done == 0:
        out.append(banner("error", "Zero records: the run holds no completed response, so nothing below is evidence.",
                          ["check the ledger (planned, errors, skipped) and the 01_generate notebook"]))
    rej = rejected_prompt_lines(ledger)
    if rej:
        lines = []
        for name, (n, first) in rej.items():
            lines.append(f"{name}: {n} prompt line(s) rejected" + (f"; first: {' | '.join(first)}" if first else ""))
        out.append(banner("warning", f"{sum(n for n, _ in rej.values())} prompt line(s) were rejected when the "
                          "datasets were read (never sent):", lines))
    return out


def audit_banners(result: Any) -> HTMLBlock:
    """03's warnings: zero records, rejected prompt lines, failed checks, checks not run, torn journal tails."""
    s = result.summary()
    out = ledger_banners(result.ledger, records=s["records"])
    if s["records"] and s["records_failed"]:
        failed = {k: v["failed"] for k, v in s["checks"].items() if v["failed"]}
        out.append(banner("error", f"{s['records_failed']} of {s['records']} records failed at least one check",
                          [f"{k}: {v} record(s)" for k, v in failed.items()]
                          + ["failed records are kept out of the training mix (and so the export) unless "
                             "hidden.include_failed; see section 6"]))
    flagged = {k: v for k, v in s["checks"].items() if v.get("flagged")}
    if s["records"] and flagged:
        out.append(banner("warning", f"{s['records_flagged']} of {s['records']} records flagged (audit.flag_only): "
                          "counted and kept in the training mix, not failed",
                          [f"{k}: {v['flagged']} record(s) ({v['flagged'] / max(v['applicable'], 1):.1%})"
                           for k, v in flagged.items()]
                          + (["text.roundtrip: encode(decode(ids)) != ids: the model's own non-canonical split, which "
                              "re-tokenizing the text would lose; examples in section 6"]
                             if "text.roundtrip" in flagged else [])))
    not_run = [k for k, v in s["checks"].items() if v["verdict"] == "not run"]
    if s["records"] and not_run:
        out.append(banner("warning", f"{len(not_run)} check(s) not run: " + ", ".join(not_run)))
    torn = s.get("torn_tail_bytes") or 0
    if torn:
        out.append(banner("warning", f"{torn} byte(s) of torn last line(s) in the journals (a crash mid-write): "
                          "not audited; 01 cuts them off when it resumes"))
    if s.get("bad_lines"):
        bad = list(s["bad_lines"])
        out.append(banner("warning", f"{len(bad)} unreadable journal line(s), not audited:", bad[:5]))
    if s["records"] and not s["records_failed"] and not not_run:
        out.append(banner("ok", f"No record failed a check ({s['records']} records; bounds in section 3)."))
    return banners(out)


def export_banners(result: Any) -> HTMLBlock:
    """05's warnings: an export without the audit filter (no verdicts, or failed records let in), nothing exported."""
    out = []
    man = next(iter(result.manifests.values()), {}) if result.manifests else {}
    sel = man.get("selection") or {}
    if not sel.get("verdicts_present"):
        out.append(banner("error", "Unaudited export: stage 03 has not written verdicts for this run, so records "
                          "went out without the audit filter.", ["run 03_audit, then 04 and 05 again"]))
    elif sel.get("include_failed"):
        out.append(banner("warning", "The export includes records that failed audit checks (include_failed is on)."))
    hv = sel.get("hidden_verification") or ""
    if hv not in ("", "passed", "no hidden states"):
        out.append(banner("error", f"Hidden states exported without passing verify-hidden: {hv}."))
    if man and not man.get("exported"):
        out.append(banner("error", "Zero records exported."))
    return banners(out)


# ------------------------------------------------------------------ audit tables for the report


def check_summary_view(result: Any) -> Any:
    """03's check table for reading: counts as integers, `upper95` and the failure rate as percentages."""
    import pandas as pd

    cs = result.check_summary()
    view = cs[["verdict", "applicable", "failed", "not_applicable", "not_run", "upper95", "records_for_0.1%",
               "more_needed", "what"]].copy()
    view["upper95"] = [("" if pd.isna(x) else f"{x:.2%}") for x in cs["upper95"]]
    for c in ("records_for_0.1%", "more_needed"):
        view[c] = [("" if pd.isna(x) else f"{int(x):,}") for x in cs[c]]
    return view


def check_matrix_html(result: Any) -> HTMLBlock:
    """Per (dataset, source, provider): only what informs — failures, not-run checks, and one pass bound per group.

    Columns are the checks that failed, flagged or were not run in some group; a cell is `FAIL k/n (r%)`,
    `flagged k/n (r%)`,
    `0/n` beside a failure elsewhere, `not run`, or blank (n/a). The last column bounds every
    other applicable check of the group at once: `N passed; weakest bound 0/n (<b%)`, from the
    check with the smallest n. The table scrolls sideways when it is wider than the page.
    """
    import html

    import pandas as pd


    ct = result.check_table()
    ct = ct[ct["check"].isin([c.name for c in iter_checks(result.profile)])]
    if len(ct) == 0:
        return HTMLBlock("<p><i>check matrix: no records</i></p>")
    gcols = ["dataset", "source", "provider"]
    informative = [c for c in CHECK_NAMES if c in set(ct.loc[(ct["failed"] > 0) | (ct["flagged"] > 0) | (
        (ct["not_run"] > 0) & (ct["applicable"] == 0)), "check"])]
    rows = []
    for key, g in ct.groupby(gcols, sort=False):
        g = g.set_index("check")
        cells = []
        for c in informative:
            r = g.loc[c] if c in g.index else None
            if r is None or (r["applicable"] == 0 and r["not_run"] == 0):
                cells.append("")
            elif r["failed"] > 0:
                cells.append(f"FAIL {int(r['failed'])}/{int(r['applicable'])} ({r['failed'] / r['applicable']:.1%})")
            elif r["flagged"] > 0:
                cells.append(f"flagged {int(r['flagged'])}/{int(r['applicable'])} "
                             f"({r['flagged'] / r['applicable']:.1%})")
            elif r["applicable"] == 0:
                cells.append("not run")
            else:
                cells.append(f"0/{int(r['applicable'])}")
        rest = g[~g.index.isin(informative) & (g["applicable"] > 0)]
        if len(rest):
            weakest = rest.sort_values("applicable").iloc[0]
            n = int(weakest["applicable"])
            cells.append(f"{len(rest)} passed; weakest bound 0/{n} (<{weakest['upper95']:.1%})")
        else:
            cells.append("")
        rows.append(list(key) + [int(g["records"].max())] + cells)
    df = pd.DataFrame(rows, columns=gcols + ["records"] + informative + ["other checks (all passed)"])
    body = df.to_html(classes="check-matrix", index=False, border=0, escape=True)
    body = body.replace("<td>FAIL", '<td style="color:#cf222e;font-weight:bold">FAIL')
    body = body.replace("<td>flagged", '<td style="color:#9a6700;font-weight:bold">flagged')
    note = ("" if informative else "<p>No check failed or went unrun in any group: one bound per group.</p>")
    legend = ("Per group: a failed check as FAIL k/n (rate), a flagging one (audit.flag_only: records kept) as "
              "flagged k/n; 0/n where it passed in this group; the last column "
              "bounds every other applicable check at once (rule of three on the smallest n).")
    return HTMLBlock(f'{note}<div style="overflow-x:auto;max-width:100%">{body}</div>'
                     f'<p style="font-size:12px;color:#555">{html.escape(legend)}</p>')


def superseded_html(result: Any) -> HTMLBlock:
    """Journal lines replaced by a later line of the same sample (a retried error): not failures, not counted."""
    sup = getattr(result, "superseded", None)
    if sup is None or len(sup) == 0:
        return HTMLBlock("")
    view = sup.copy()
    if "file" in view.columns:
        view["file"] = [shown_path(f) if f else "" for f in view["file"]]
    return show_table(view.reset_index(drop=True), "superseded-table",
                      caption=f"Superseded journal lines ({len(view)}): a retried error replaced by a later line of "
                              "the same sample; not a failure, not counted")
