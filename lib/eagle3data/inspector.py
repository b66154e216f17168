"""The sample inspector: one record's prompt, output, templated sequence and verdicts as HTML.

`inspect_record(result, dataset, sample_id, tokenizer)` returns a `RecordView` whose
`_repr_html_` renders in JupyterLab and, through the executed notebook, in the report. Every
special token is a visible badge, token boundaries alternate shading (so a seam split shows),
and the loss-mask span (the trained output) is shaded in the full sequence. Styles are
inline: nothing external is loaded.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import numpy as np

from .audit import AuditResult
from .checks import FAIL, NA, NOT_RUN, PASS, STATUS_NAMES

_STATUS_STYLE = {PASS: "color:#1a7f37", FAIL: "color:#fff;background:#cf222e;font-weight:bold",
                 NA: "color:#777", NOT_RUN: "color:#9a6700"}
_BOX = "border:1px solid #ddd;border-radius:4px;padding:6px;margin:4px 0;font-family:monospace;" \
       "font-size:12px;white-space:pre-wrap;word-break:break-all;line-height:1.6"


@dataclass
class RecordView:
    """HTML of one inspected record; displays itself in Jupyter."""

    html: str
    dataset: str | None
    sample_id: Any
    found: bool

    def _repr_html_(self) -> str:
        return self.html

    def __str__(self) -> str:
        return f"RecordView({self.dataset}, {self.sample_id})"


def _esc(s: str) -> str:
    return html.escape(s, quote=False)


def _token_spans(ids: np.ndarray, tokenizer: Any, specials: dict[int, str], *, start: int = 0,
                 mask: np.ndarray | None = None, limit: int = 3000) -> str:
    """Tokens as spans: specials as badges, ordinary tokens alternating shade, masked ones tinted."""
    n = len(ids)
    keep = np.arange(n) if n <= limit else np.r_[np.arange(limit * 3 // 4), np.arange(n - limit // 4, n)]
    out, prev = [], -1
    for j in keep.tolist():
        if prev >= 0 and j != prev + 1:
            out.append(f'<span style="color:#cf222e">[… {j - prev - 1} tokens not shown …]</span>')
        prev = j
        t = int(ids[j])
        title = f"pos {start + j} · id {t}"
        trained = mask is not None and bool(mask[j])
        if t in specials:
            out.append(f'<span title="{title}" style="background:#0969da;color:#fff;border-radius:3px;'
                       f'padding:0 3px;margin:0 1px">{_esc(specials[t])}</span>')
            continue
        text = tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else f"⟨{t}⟩"
        shade = ("#fff1c2" if j % 2 else "#ffe08a") if trained else ("#f6f8fa" if j % 2 else "#e8ebef")
        out.append(f'<span title="{title}" style="background:{shade}">{_esc(text)}</span>')
    return "".join(out)


def _verdict_table(result: AuditResult, i: int) -> str:
    rows = []
    from .checks import CHECKS

    for c in result.status.columns:
        s = int(result.status.at[i, c])
        rows.append(f'<tr><td style="text-align:left">{c}</td><td style="{_STATUS_STYLE[s]};padding:0 6px">'
                    f'{STATUS_NAMES[s]}</td><td style="text-align:left;color:#555">{_esc(CHECKS[c].what)}</td></tr>')
    return ('<table style="border-collapse:collapse;font-size:12px"><thead><tr><th>check</th><th>verdict</th>'
            '<th>what it asserts</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>")


def _messages_html(messages: list | None, tools: list | None) -> str:
    if not messages:
        return "<p><i>the record holds no prompt messages</i></p>"
    colors = {"system": "#ddf4ff", "user": "#fff8c5", "assistant": "#dafbe1", "tool": "#fbefff"}
    parts = []
    for m in messages:
        role = str(m.get("role"))
        parts.append(f'<div style="{_BOX};background:{colors.get(role, "#fff")}"><b>{_esc(role)}</b>\n'
                     f'{_esc(str(m.get("content")))}</div>')
    if tools:
        names = [(t.get("function") or t).get("name") for t in tools if isinstance(t, dict)]
        parts.append(f"<p>tools declared: <code>{_esc(', '.join(str(n) for n in names))}</code></p>")
    return "".join(parts)


def find_record(result: AuditResult, dataset: str | None, sample_id: Any) -> tuple[int | None, str]:
    """Row of the wanted record, else the first record, with a note saying which was shown."""
    if sample_id is not None:
        i = result.record_index(dataset, sample_id)
        if i is not None:
            return i, ""
        where = f"dataset {dataset}, " if dataset else ""
        note = f"{where}sample_id {sample_id} is not in this run"
    else:
        note = "no sample asked for"
    if len(result.meta) == 0:
        return None, note + "; the run has no records."
    m = result.meta.iloc[0]
    return 0, note + f"; showing the first record instead ({m['dataset']}, sample_id {m['sample_id']})."


def inspect_record(result: AuditResult, dataset: str | None = None, sample_id: Any = None, tokenizer: Any = None,
                   *, limit: int = 3000) -> RecordView:
    """One record laid out for a human: metadata, verdicts, prompt messages, output, full sequence."""
    i, note = find_record(result, dataset, sample_id)
    if i is None:
        return RecordView(f"<p><b>Inspector:</b> {_esc(note)}</p>", dataset, sample_id, False)
    t = result.table
    m = t.meta.iloc[i]
    prof = result.profile
    specials = {tok.id: tok.text for tok in prof.special_tokens()}
    if tokenizer is not None:
        for sid in set(t.prompt_ids(i).tolist()) | set(t.output_ids(i).tolist()):
            txt = tokenizer.convert_ids_to_tokens(int(sid)) if 0 <= sid < len(tokenizer) else None
            if txt is not None and sid in getattr(tokenizer, "all_special_ids", []):
                specials.setdefault(int(sid), txt)
    pids, oids = t.prompt_ids(i), t.output_ids(i)
    failed = [c for c in result.status.columns if result.status.at[i, c] == FAIL]
    head = (f'<h4 style="margin:4px 0">{_esc(str(m["dataset"]))} · sample {_esc(str(m["sample_id"]))}</h4>'
            + (f'<p style="color:#9a6700"><b>Note:</b> {_esc(note)}</p>' if note else "")
            + f'<p style="font-size:12px">source <b>{_esc(str(m.get("source")))}</b> · provider '
            f'{_esc(str(m.get("provider")))} · finish_reason <b>{_esc(str(m["finish_reason"]))}</b> · ids from '
            f'{_esc(str(m.get("ids_from", "journal")))} · prompt {len(pids)} tokens · output {len(oids)} tokens · '
            f'{_esc(str(m.get("file", "")))}:{m.get("line", "")}<br>'
            + (f'<span style="color:#cf222e"><b>failed:</b> {_esc(", ".join(failed))}</span>' if failed
               else '<span style="color:#1a7f37"><b>no check failed</b></span>') + "</p>")
    # special-token positions
    ev = result.positions.events
    ev = ev[ev["record"] == i]
    pos_rows = "".join(f"<tr><td>{_esc(r.token)}</td><td>{r.pos}</td><td>{len(pids) + r.pos}</td></tr>"
                       for r in ev.itertuples())
    pos_html = ('<table style="font-size:12px"><thead><tr><th>token</th><th>position in output</th>'
                '<th>position in full sequence</th></tr></thead><tbody>' + pos_rows + "</tbody></table>"
                if pos_rows else "<p><i>no special token of the profile in the output</i></p>")
    mask = None
    if t.loss_mask is not None and t.loss_mask[i] is not None and len(t.loss_mask[i]) == len(pids) + len(oids):
        mask = np.asarray(t.loss_mask[i], dtype=bool)
    if mask is None:
        mask = np.r_[np.zeros(len(pids), bool), np.ones(len(oids), bool)]
    full = np.r_[pids, oids]
    body = (
        head
        + "<details open><summary><b>Check verdicts</b></summary>" + _verdict_table(result, i) + "</details>"
        + "<details open><summary><b>Prompt messages by role</b></summary>"
        + _messages_html(t.messages[i] if t.messages else None, t.tools[i] if t.tools else None) + "</details>"
        + "<details open><summary><b>Decoded output</b> (special tokens as blue badges; alternating shade = "
        "token boundaries; hover for position and id)</summary>"
        + f'<div style="{_BOX}">' + _token_spans(oids, tokenizer, specials, start=len(pids), limit=limit)
        + "</div></details>"
        + "<details open><summary><b>Special-token positions</b></summary>" + pos_html + "</details>"
        + "<details open><summary><b>Full templated sequence</b> (grey = prompt, loss mask 0; yellow = trained "
        "span, loss mask 1)</summary>"
        + f'<div style="{_BOX}">' + _token_spans(full, tokenizer, specials, mask=mask, limit=limit)
        + "</div></details>"
    )
    html_out = f'<div style="border:1px solid #bbb;padding:8px;margin:8px 0;border-radius:6px">{body}</div>'
    return RecordView(html_out, str(m["dataset"]), m["sample_id"], not note)


def failing_records(result: AuditResult, tokenizer: Any = None, k: int = 3) -> list[RecordView]:
    """The first k failing records of each failed check, as inspector views."""
    views, seen = [], set()
    for c in result.status.columns:
        for r in result.failing(c, k).itertuples():
            key = (r.dataset, str(r.sample_id))
            if key in seen:
                continue
            seen.add(key)
            views.append(inspect_record(result, r.dataset, r.sample_id, tokenizer, limit=800))
    return views
