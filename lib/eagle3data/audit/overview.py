"""The report's opening: one summary of the run across the stages that ran, read from the files they wrote.

Records and tokens per dataset (03's `audit/summary.json`, else 01's `ledger.json`) with what each cost and
what went into 04's training mix (`hidden/mix_manifest.json`); the audit's verdict with its 95% bounds;
verify-hidden's verdict on the stored states (`hidden/verify_summary.json`); what 05 handed to each trainer
(`export/<format>/manifest.json`); and, when 06 ran, τ per variant and evaluation set (`value/summary.json`).
Each line links to its section below. Files are read as written (no later stage is imported): a stage that
did not run leaves its line out.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from eagle3data.core.provenance import RunParamsError, params_of_run
from eagle3data.core.stats import upper95_text

SUMMARY_ID = "e3-summary"
VERIFY_ID = "e3-verify"  # the ids render_report gives the sections it appends after the notebook
VALUE_ID = "e3-value"
HEADING = re.compile(r'<h([1-3])[^>]*\bid="([^"]+)"[^>]*>(.*?)</h\1>', re.S)


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment)).replace("\u00b6", "").strip()


def section_links(page: str) -> list[tuple[str, str]]:
    """(id, heading text) of every section heading (h2) on the page, in page order."""
    return [(i, _text(t)) for lvl, i, t in HEADING.findall(page) if lvl == "2"]


def _link(label: str, anchor: str | None) -> str:
    return f'<a href="#{html.escape(anchor)}">{label}</a>' if anchor else label


def _find(sections: list[tuple[str, str]], word: str) -> str | None:
    return next((i for i, t in sections if word.lower() in t.lower()), None)


def _stages(run_dir: Path) -> list[str]:
    return sorted(p.stem for p in (run_dir / "provenance").glob("*.json"))


def _dataset_table(audit: dict | None, ledger: dict | None, mix: dict | None, anchor: str | None) -> str:
    """Per dataset: records, prompt and output tokens, cost, records failing the audit, what 04's mix kept."""
    rows: dict[str, dict[str, Any]] = {}
    for name, d in ((ledger or {}).get("datasets") or {}).items():
        d = d or {}
        rows[name] = {"records": d.get("done"), "prompt": d.get("prompt_tokens"), "output": d.get("completion_tokens"),
                      "cost": d.get("cost_usd") or 0.0}
    if audit is not None:  # the audited ids, not 01's usage, where 03 ran
        for name in rows:
            rows[name].update(records=0, prompt=0, output=0, failed=0)
        for g in audit.get("groups") or []:
            r = rows.setdefault(g["dataset"], {"records": 0, "prompt": 0, "output": 0, "failed": 0, "cost": None})
            r["records"] += g.get("records") or 0
            r["prompt"] += g.get("prompt_tokens") or 0
            r["output"] += g.get("output_tokens") or 0
            r["failed"] += g.get("failed") or 0
    for name, d in ((mix or {}).get("datasets") or {}).items():
        rows.setdefault(name, {}).update(mix=d.get("samples"), mix_tokens=d.get("tokens"), trained=d.get("loss_tokens"))
    if not rows:
        return ""
    cols = [("records", "records"), ("prompt", "prompt tokens"), ("output", "output tokens"), ("cost", "cost")]
    if audit is not None:
        cols.append(("failed", "failed the audit"))
    if mix is not None:
        cols += [("mix", "in the training mix"), ("mix_tokens", "mix tokens"), ("trained", "trained tokens")]

    def cell(key: str, v: Any) -> str:
        if v is None:
            return ""
        return f"${v:,.2f}" if key == "cost" else f"{v:,}"

    total = {k: sum(r.get(k) or 0 for r in rows.values()) for k, _ in cols}
    body = "".join(f"<tr><td>{html.escape(name)}</td>" + "".join(f"<td>{cell(k, r.get(k))}</td>" for k, _ in cols)
                   + "</tr>" for name, r in rows.items())
    body += ("<tr><td><b>all</b></td>" + "".join(f"<td><b>{cell(k, total[k])}</b></td>" for k, _ in cols) + "</tr>"
             if len(rows) > 1 else "")
    head = "<tr><th>dataset</th>" + "".join(f"<th>{h}</th>" for _, h in cols) + "</tr>"
    note = "" if anchor is None else f' <span style="font-size:12px">({_link("ledger", anchor)})</span>'
    return (f"<p><b>Records and tokens per dataset</b>{note}</p>"
            f'<table class="e3-summary-datasets" border="0"><thead>{head}</thead><tbody>{body}</tbody></table>')


def _weakest(checks: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The passing check with the loosest 95% bound (the one with the fewest applicable records)."""
    passed = [(n, c) for n, c in checks.items() if not c.get("failed") and not c.get("flagged") and c.get("applicable")
              and c.get("upper95") is not None]
    return max(passed, key=lambda nc: nc[1]["upper95"]) if passed else None


def _audit_line(audit: dict[str, Any]) -> str:
    checks = audit.get("checks") or {}
    n, bad = audit.get("records") or 0, audit.get("records_failed") or 0
    failed = [f"{html.escape(k)} {c['failed']}/{c['applicable']}" for k, c in checks.items() if c.get("failed")]
    not_run = [k for k, c in checks.items() if c.get("verdict") == "not run"]
    head = (f"{bad} of {n:,} records failed a check ({', '.join(failed)})" if bad
            else f"no record failed a check ({n:,} records)")
    w = _weakest(checks)
    passed = sum(1 for c in checks.values() if not c.get("failed") and not c.get("flagged") and c.get("applicable"))
    bound = (f"; {'the other ' if failed else ''}{passed} applicable checks passed, each failure rate below "
             f"{upper95_text(w[1])} at 95% (loosest: {html.escape(w[0])}, 0/{w[1]['applicable']:,})" if w else "")
    cut = audit.get("records_truncated") or 0
    flags = [f"{html.escape(k)} {c['flagged']}/{c['applicable']}" for k, c in checks.items() if c.get("flagged")]
    return (head + bound + (f"; {len(not_run)} not run" if not_run else "")
            + (f"; {audit.get('records_flagged', 0):,} records flagged, kept ({', '.join(flags)})" if flags else "")
            + (f"; {cut:,} records truncated (finish_reason length: reported, not failed)" if cut else ""))


def _verify_line(v: dict[str, Any]) -> str:
    checks = v.get("checks") or {}
    if v.get("ok"):
        head = f"passed: no stored sample failed ({v.get('samples', 0):,} samples, {v.get('tokens', 0):,} tokens)"
    else:
        failed = [f"{html.escape(k)} {c['failed']}" for k, c in checks.items() if c.get("failed")]
        run = [html.escape(p.get("check", "?")) for p in v.get("store_problems") or []]
        head = (f"<b>failed</b>: {v.get('failed_samples', 0):,} of {v.get('samples', 0):,} stored samples"
                + (f" ({', '.join(failed)})" if failed else "") + (f"; the run failed {', '.join(run)}" if run else ""))
    w = _weakest(checks)
    bound = (f"; each passing check's failure rate below {upper95_text(w[1])} at 95% (loosest: "
             f"{html.escape(w[0])}, 0/{w[1]['applicable']:,})" if w else "")
    return head + bound + f"; {v.get('recomputed', 0)} sample(s) recomputed through the target"


def _export_line(manifests: dict[str, dict[str, Any]]) -> str:
    parts = [f"{html.escape(fmt)} {m.get('exported', 0):,} samples, {m.get('tokens', 0):,} tokens"
             for fmt, m in manifests.items()]
    sel = next(iter(manifests.values())).get("selection") or {}
    hv = sel.get("hidden_verification")
    tt = next((m["text_trainers"] for m in manifests.values() if isinstance(m.get("text_trainers"), dict)), None)
    text = (f"; text-only trainers (chat template as text, re-encoded) reproduce our ids for {tt['reproduced']:,} of "
            f"{tt['rows']:,} rows" if tt and tt.get("reproduced") is not None else "")
    return "; ".join(parts) + (f" (states: verify-hidden {html.escape(str(hv))})" if hv else "") + text


def _value_line(value: dict[str, Any]) -> str:
    """τ per variant and evaluation set: the engine's (vLLM speculative decoding), else the offline one."""
    k = (value.get("eval") or {}).get("num_speculative_tokens")
    parts = []
    for v in value.get("variants") or []:
        sets = []
        for ds, f in (v.get("per_dataset") or {}).items():
            kind = "tau_engine" if f.get("tau_engine") is not None else "tau_offline"
            ci = f.get(f"{kind}_ci95") or []
            sets.append(f"{html.escape(ds)} <b>{f.get(kind)}</b>" + (f" ({ci[0]}–{ci[1]})" if len(ci) == 2 else "")
                        + ("" if kind == "tau_engine" else " offline"))
        parts.append(f"{html.escape(str(v.get('variant')))}: {', '.join(sets) or 'not evaluated'}")
    return (f"τ engine{f' (k = {k})' if k else ''}, 95% intervals: " + "; ".join(parts)) if parts else ""


def hidden_dir_of(run_dir: Path) -> Path:
    """The run's hidden-state folder: `hidden.out_dir` of the params recorded in the run, else `<run>/hidden`."""
    try:
        out_dir = params_of_run(run_dir).hidden.out_dir
    except RunParamsError:
        return run_dir / "hidden"
    return Path(out_dir) if out_dir else run_dir / "hidden"


def summary_html(run_dir: str | Path, page: str = "") -> str:
    """The run summary that opens `report.html`; `page` is the report's HTML, whose section headings it links to."""
    run_dir = Path(run_dir)
    sections = section_links(page)
    ledger, audit = _json(run_dir / "ledger.json"), _json(run_dir / "audit" / "summary.json")
    hdir = hidden_dir_of(run_dir)
    mix, verify = _json(hdir / "mix_manifest.json"), _json(hdir / "verify_summary.json")
    manifests = {p.parent.name: m for p in sorted((run_dir / "export").glob("*/manifest.json")) if (m := _json(p))}
    value = _json(run_dir / "value" / "summary.json")
    stages = _stages(run_dir)
    lines = []
    cost = sum(float((d or {}).get("cost_usd") or 0.0) for d in ((ledger or {}).get("datasets") or {}).values())
    if ledger is not None:
        lines.append(("Cost (01)", _find(sections, "Ledger"),
                      f"${cost:,.2f}" + ("" if cost else " (no API billed this run)")))
    if audit is not None:
        lines.append(("Audit (03)", _find(sections, "Checks"), _audit_line(audit)))
    if verify is not None:
        lines.append(("States verified (04)", VERIFY_ID if VERIFY_ID in page else None, _verify_line(verify)))
    if manifests:
        lines.append(("Hand-off (05)", None, _export_line(manifests)))
    if value is not None and _value_line(value):
        lines.append(("What the data is worth (06)", VALUE_ID if VALUE_ID in page else None, _value_line(value)))
    items = "".join(f"<li><b>{_link(html.escape(label), a)}</b>: {text}</li>" for label, a, text in lines)
    nav = sections + [(VERIFY_ID, "Hidden states (04): verification")] * (VERIFY_ID in page) \
        + [(VALUE_ID, "06 · What the data is worth")] * (VALUE_ID in page)
    nav_html = " · ".join(_link(html.escape(t), i) for i, t in nav)
    return (f'<div id="{SUMMARY_ID}" class="e3-summary" style="margin:1em 2em">'
            f"<h1>Run {html.escape(run_dir.name)}</h1>"
            f"<p>Stages that ran: {html.escape(', '.join(stages) or 'none recorded')}.</p>"
            + _dataset_table(audit, ledger, mix, _find(sections, "Ledger"))
            + (f'<ul class="e3-summary-lines">{items}</ul>' if items else "")
            + (f'<p style="font-size:13px">Sections: {nav_html}</p>' if nav_html else "") + "</div>")
