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
from pathlib import Path
from typing import Any

import numpy as np

from .audit import AuditResult
from .checks import FAIL, NA, NOT_RUN, PASS, STATUS_NAMES

_STATUS_STYLE = {PASS: "color:#1a7f37", FAIL: "color:#fff;background:#cf222e;font-weight:bold",
                 NA: "color:#777", NOT_RUN: "color:#9a6700"}
_BOX = "border:1px solid #ddd;border-radius:4px;padding:6px;margin:4px 0;font-family:monospace;" \
       "font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere;line-height:1.6"
# token boxes: a token never wraps inside itself (`white-space:pre` on each token), lines break only
# at token boundaries (`<wbr>` between tokens); a run longer than the box scrolls
_TOKBOX = "border:1px solid #ddd;border-radius:4px;padding:6px;margin:4px 0;font-family:monospace;" \
          "font-size:12px;white-space:pre-wrap;word-break:normal;overflow-wrap:normal;overflow-x:auto;line-height:1.6"
# Classes for the token spans (one <style> per view, names prefixed so nothing else in a page is touched).
# Whitespace is drawn with visible markers (space ·, newline ↵, tab →): nbconvert collapses a text node
# that holds only whitespace ("\n    " becomes "\n"), so an indentation token would vanish from the report.
_TOKEN_CSS = ("<style>.e3-tok{white-space:pre}.e3-p0{background:#f6f8fa}.e3-p1{background:#e8ebef}"
              ".e3-t0{background:#fff1c2}.e3-t1{background:#ffe08a}.e3-ws{color:#8c959f}"
              ".e3-sp{background:#0969da;color:#fff;border-radius:3px;padding:0 3px;margin:0 1px}"
              ".e3-div{outline:2px solid #cf222e}</style>")
_WS_MARK = {" ": "\u00b7", "\t": "\u2192", "\r": "\u240d", "\u00a0": "\u237d"}


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


def token_html(text: str) -> str:
    """One token's text as HTML that survives nbconvert: whitespace drawn with visible markers.

    A newline is drawn as `↵` followed by the line break; in a token made only of whitespace
    (indentation, blank lines) every space is `·` and a tab `→`, so the token keeps its width and
    stays visible. A token that decodes to nothing is drawn as `∅`.
    """
    if text == "":
        return '<span class="e3-ws">\u2205</span>'
    ws_only = text.strip() == ""
    out: list[str] = []
    mark: list[str] = []

    def flush() -> None:
        if mark:
            out.append('<span class="e3-ws">' + "".join(mark) + "</span>")
            mark.clear()

    for ch in text:
        if ch == "\n":
            mark.append("\u21b5\n")
        elif ws_only and ch.isspace():
            mark.append(_WS_MARK.get(ch, "\u00b7"))
        else:
            flush()
            out.append(_esc(ch))
    flush()
    return "".join(out)


def _token_spans(ids: np.ndarray, tokenizer: Any, specials: dict[int, str], *, start: int = 0,
                 mask: np.ndarray | None = None, limit: int = 3000, marked: set[int] | frozenset = frozenset()
                 ) -> str:
    """Tokens as spans: specials as badges, ordinary tokens alternating shade, masked ones tinted.

    Each token is one `span.e3-tok` (hover: position and id) and lines break only between
    tokens (`<wbr>`). Positions in `marked` (indices into `ids`) are outlined in red.
    """
    n = len(ids)
    keep = np.arange(n) if n <= limit else np.r_[np.arange(limit * 3 // 4), np.arange(n - limit // 4, n)]
    out, prev = [], -1
    for j in keep.tolist():
        if prev >= 0 and j != prev + 1:
            out.append(f'<span style="color:#cf222e">[… {j - prev - 1} tokens not shown …]</span><wbr>')
        prev = j
        t = int(ids[j])
        title = f"pos {start + j} · id {t}"
        trained = mask is not None and bool(mask[j])
        extra = " e3-div" if j in marked else ""
        if t in specials:
            out.append(f'<span title="{title}" class="e3-tok e3-sp{extra}">{_esc(specials[t])}</span><wbr>')
            continue
        text = tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else f"⟨{t}⟩"
        shade = ("e3-t1" if j % 2 else "e3-t0") if trained else ("e3-p1" if j % 2 else "e3-p0")
        out.append(f'<span title="{title}" class="e3-tok {shade}{extra}">{token_html(text)}</span><wbr>')
    return "".join(out)


def first_divergence(a: Any, b: Any) -> int | None:
    """First index where two id sequences differ (the shorter one's length when one is a prefix), else None."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    if len(neq):
        return int(neq[0])
    return None if len(a) == len(b) else n


def _divergence_table(ids: list[int], again: list[int], k: int, tokenizer: Any, start: int, window: int = 4) -> str:
    """Both sides around the first divergence: position, id and token text of the record and of decode→encode."""
    lo, hi = max(0, k - window), max(len(ids), len(again))
    hi = min(hi, k + window + 1)
    rows = []
    for j in range(lo, hi):
        cells = []
        for seq in (ids, again):
            if j < len(seq):
                tid = int(seq[j])
                cells.append(f"<td>{tid}</td><td class=\"e3-tok {'e3-p1' if j % 2 else 'e3-p0'}\">"
                             f"{token_html(tokenizer.decode([tid], skip_special_tokens=False))}</td>")
            else:
                cells.append('<td colspan="2" style="color:#777">(ends)</td>')
        style = ' style="background:#ffebe9;font-weight:bold"' if j == k else ""
        rows.append(f"<tr{style}><td>{start + j}</td><td>{j}</td>{''.join(cells)}</tr>")
    return ('<table style="font-size:12px;font-family:monospace"><thead><tr><th>full pos</th><th>output pos</th>'
            '<th>record id</th><th>record token</th><th>re-encoded id</th><th>re-encoded token</th></tr></thead>'
            "<tbody>" + "".join(rows) + "</tbody></table>")


def divergence_html(oids: Any, tokenizer: Any, start: int = 0, failed: bool = False) -> str:
    """Where encode(decode(output ids)) first differs from the ids: position, both sides' ids and tokens.

    Empty when the roundtrip gives the same ids (and the record did not fail text.roundtrip).
    """
    if tokenizer is None or oids is None:
        return ""
    ids = [int(t) for t in oids]
    again = [int(t) for t in tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False),
                                              add_special_tokens=False)]
    k = first_divergence(ids, again)
    if k is None:
        return ("<p><i>decode→encode gives the same ids (the record's text.roundtrip verdict comes from the "
                "audit run)</i></p>" if failed else "")
    return (f'<p style="color:#cf222e"><b>decode→encode diverges at output position {k}</b> (full sequence '
            f"position {start + k}): the record has {len(ids)} output ids, re-encoding its text gives "
            f"{len(again)} ({len(again) - len(ids):+d}); the record's id there is "
            f"{ids[k] if k < len(ids) else '(none)'}, re-encoding gives {again[k] if k < len(again) else '(none)'}."
            "</p>" + _divergence_table(ids, again, k, tokenizer, start))


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


def shown_record_path(path: Any) -> str:
    """A journal path as the report shows it: relative to the run folder (`records/b1.jsonl`), never absolute."""
    if not path or (isinstance(path, float) and np.isnan(path)):
        return ""
    p = Path(str(path))
    if p.parent.name in ("records", "reconstruct"):
        return f"{p.parent.name}/{p.name}"
    return p.name


def _count_html(m: Any) -> str:
    """For a record whose ids 02 rebuilt from text: rebuilt length against the billed completion_tokens."""
    if str(m.get("ids_from")) != "reconstruct" or not m.get("file"):
        return ""
    from .reader import SampleKey, read_rebuilt

    try:
        run_dir = Path(str(m["file"])).parent.parent
        reb = read_rebuilt(run_dir, [str(m["dataset"])])
    except Exception as e:  # noqa: BLE001 - the inspector shows what it can; the audit already read this file
        return f"<p><i>reconstruct/{_esc(str(m['dataset']))}.jsonl not readable here: {_esc(str(e))}</i></p>"
    r = reb.get(SampleKey(str(m["dataset"]), str(m["sample_id"])))
    if r is None:
        return ""
    billed, n = r.get("billed_tokens"), r.get("rebuilt_tokens", len(r.get("output_ids") or []))
    flags = r.get("flags") or []
    bad = "count_outside_tolerance" in flags or "count_off_offset" in flags
    seam = r.get("seam_first_diff")
    txt = ((f"proof level {r['proof_level']}; " if r.get("proof_level") else "")
           + f"rebuilt {n} output tokens; the API billed {billed if billed is not None else '(no count)'}"
           + (f" ({n - billed:+d}; calibrated offset {r.get('count_offset', 0):+d})" if billed is not None else "")
           + (f"; flags: {', '.join(map(str, flags))}" if flags else "")
           + (f"; the seam join diverges at output position {seam}" if seam is not None else "")
           + ". An API record has no true ids to compare with: a count difference cannot be placed at a position; "
           "the roundtrip section above says whether the rebuilt ids are canonical.")
    return f'<p style="{"color:#cf222e" if bad else ""}">{_esc(txt)}</p>'


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
    provider = m.get("provider")
    provider = None if provider is None or (isinstance(provider, float) and np.isnan(provider)) else provider
    where = shown_record_path(m.get("file", ""))
    head = (f'<h4 style="margin:4px 0">{_esc(str(m["dataset"]))} · sample {_esc(str(m["sample_id"]))}</h4>'
            + (f'<p style="color:#9a6700"><b>Note:</b> {_esc(note)}</p>' if note else "")
            + f'<p style="font-size:12px">source <b>{_esc(str(m.get("source")))}</b>'
            + (f" · provider <b>{_esc(str(provider))}</b>" if provider else "")
            + f' · finish_reason <b>{_esc(str(m["finish_reason"]))}</b> · ids from '
            f'{_esc(str(m.get("ids_from", "journal")))} · prompt {len(pids)} tokens · output {len(oids)} tokens'
            + (f" · {_esc(where)}:{m.get('line', '')}" if where else "") + "<br>"
            + (f'<span style="color:#cf222e"><b>failed:</b> {_esc(", ".join(failed))}</span>' if failed
               else '<span style="color:#1a7f37"><b>no check failed</b></span>') + "</p>")
    div_html, div_at = "", None
    if tokenizer is not None and t.has_output[i]:
        div_html = divergence_html(oids, tokenizer, start=len(pids), failed="text.roundtrip" in failed)
        ids_l = [int(x) for x in oids]
        again = tokenizer.encode(tokenizer.decode(ids_l, skip_special_tokens=False), add_special_tokens=False)
        div_at = first_divergence(ids_l, again)
    count_html = _count_html(m)
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
        + f'<div style="{_TOKBOX}">' + _token_spans(oids, tokenizer, specials, start=len(pids), limit=limit,
                                                    marked={div_at} if div_at is not None else frozenset())
        + "</div></details>"
        + ("<details open><summary><b>Roundtrip: where decode→encode diverges</b> (outlined in red above)"
           "</summary>" + div_html + "</details>" if div_html else "")
        + ("<details open><summary><b>Token count against the API's billed count</b></summary>" + count_html
           + "</details>" if count_html else "")
        + "<details open><summary><b>Special-token positions</b></summary>" + pos_html + "</details>"
        + "<details open><summary><b>Full templated sequence</b> (grey = prompt, loss mask 0; yellow = trained "
        "span, loss mask 1)</summary>"
        + f'<div style="{_TOKBOX}">' + _token_spans(full, tokenizer, specials, mask=mask, limit=limit,
                                                    marked={len(pids) + div_at} if div_at is not None else frozenset())
        + "</div></details>"
    )
    html_out = _TOKEN_CSS + f'<div style="border:1px solid #bbb;padding:8px;margin:8px 0;border-radius:6px">{body}</div>'
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
