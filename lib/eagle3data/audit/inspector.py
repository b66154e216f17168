"""The sample inspector: one record's prompt, output, templated sequence and verdicts as HTML.

`inspect_record(result, dataset, sample_id, tokenizer)` returns a `RecordView` whose
`_repr_html_` renders in JupyterLab and, through the executed notebook, in the report. Every
special token is a visible badge, token boundaries alternate shading (so a seam split shows),
and the loss-mask span (the trained output) is shaded in the full sequence. Styles are
inline: nothing external is loaded.

A turn of a conversation regenerated turn by turn (`generate.turns: all`; asked for as
`sample_id="12#1"`, or `sample_id=12` for the conversation's last turn) also shows its
conversation: every turn in order (prompt and output lengths and ids, finish reason, how the
conversation ended, how much of each prompt repeats an earlier turn's sequence), and for the
inspected turn where each message of its history came from: the model's own reply of turn K,
a dataset message (system, user, a tool result spliced after turn K's call), or an assistant
message that is no journaled turn (the dataset's reply: off-policy).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle3data.audit.run import AuditResult
from eagle3data.audit.checks import CHECKS, FAIL, FLAG, NA, NOT_RUN, PASS, STATUS_NAMES
from eagle3data.audit.rebuilt import RebuiltIds
from eagle3data.audit.streamed import RecordFacts
from eagle3data.core.reader import DatasetLines, RunView, SampleKey, read_rebuilt, read_run
from eagle3data.generate.turns import conversation_turns

_STATUS_STYLE = {PASS: "color:#1a7f37", FAIL: "color:#fff;background:#cf222e;font-weight:bold",
                 NA: "color:#777", NOT_RUN: "color:#9a6700", FLAG: "color:#fff;background:#9a6700;font-weight:bold"}
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

    for c in result.status.columns:
        s = int(result.status.at[i, c])
        rows.append(f'<tr><td style="text-align:left">{c}</td><td style="{_STATUS_STYLE[s]};padding:0 6px">'
                    f'{STATUS_NAMES[s]}</td><td style="text-align:left;color:#555">{_esc(CHECKS[c].what)}</td></tr>')
    return ('<table style="border-collapse:collapse;font-size:12px"><thead><tr><th>check</th><th>verdict</th>'
            '<th>what it asserts</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>")


def _messages_html(messages: list | None, tools: list | None, sources: list[str] | None = None) -> str:
    """Prompt messages by role; with `sources` (a turn record) each says where it came from (`history_labels`)."""
    if not messages:
        return "<p><i>the record holds no prompt messages</i></p>"
    colors = {"system": "#ddf4ff", "user": "#fff8c5", "assistant": "#dafbe1", "tool": "#fbefff"}
    parts = []
    for k, m in enumerate(messages):
        role = str(m.get("role"))
        label = ""
        if sources is not None and k < len(sources):
            off = "NOT" in sources[k]
            label = (f' <span style="font-weight:normal;{"color:#cf222e;font-weight:bold" if off else "color:#555"}">'
                     f"· {_esc(sources[k])}</span>")
        calls = m.get("tool_calls") or []
        names = [str((c.get("function") or {}).get("name")) for c in calls if isinstance(c, dict)]
        parts.append(f'<div style="{_BOX};background:{colors.get(role, "#fff")}"><b>{_esc(role)}</b>{label}\n'
                     f'{_esc(str(m.get("content")))}'
                     + (f"\n<i>tool calls: {_esc(', '.join(names))}</i>" if names else "") + "</div>")
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


def _count_html(m: Any, rebuilt: RebuiltIds | None = None) -> str:
    """For a record whose ids 02 rebuilt from text: rebuilt length against the billed completion_tokens
    (`rebuilt`: the run's index of 02's lines, when the audit read the run in chunks; else the file is read)."""
    if str(m.get("ids_from")) != "reconstruct" or not m.get("file"):
        return ""

    try:
        if rebuilt is not None:
            reb: Any = rebuilt.wholes()
        else:
            reb = read_rebuilt(Path(str(m["file"])).parent.parent, [str(m["dataset"])])
        r = reb.get(SampleKey.of(m))
    except Exception as e:  # noqa: BLE001 - the inspector shows what it can; the audit already read this file
        return f"<p><i>reconstruct/{_esc(str(m['dataset']))}.jsonl not readable here: {_esc(str(e))}</i></p>"
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


def _journal(result: AuditResult, i: int, views: dict[Any, Any]) -> tuple[Any, str]:
    """Row i's dataset journal through the one reader (read once per page: `views` keeps it), or a reason."""
    m = result.meta.iloc[i]
    f = m.get("file")
    if not f or (isinstance(f, float) and np.isnan(f)):
        return None, "the audit table names no journal for this record"
    run_dir, ds = Path(str(f)).parent.parent, str(m["dataset"])
    if isinstance(result.table, RecordFacts):  # the run read in chunks: this conversation's records, read back alone
        sid = str(m["sample_id"])
        if (run_dir, ds, sid) not in views:
            meta = result.meta
            rows = np.flatnonzero(((meta["dataset"].astype(str) == ds) & (meta["sample_id"].astype(str) == sid)
                                   ).to_numpy() & ~np.isnan(_turns_of(meta)))
            try:
                lines = [result.table.line(int(j)) for j in rows]
                views[run_dir, ds, sid] = RunView(run_dir, {ds: DatasetLines(ds, Path(str(f)), lines, [True] * len(lines),
                                                                            [False] * len(lines))}, {}, None)
            except Exception as e:  # noqa: BLE001 - the inspector shows what it can; the audit already read it
                views[run_dir, ds, sid] = e
        v = views[run_dir, ds, sid]
    else:
        if (run_dir, ds) not in views:
            try:
                views[run_dir, ds] = read_run(run_dir, [ds], rebuilt=False, verdicts=False)
            except Exception as e:  # noqa: BLE001 - the inspector shows what it can; the audit already read it
                views[run_dir, ds] = e
        v = views[run_dir, ds]
    return (None, f"records/{ds}.jsonl not readable here: {v}") if isinstance(v, Exception) else (v, "")


def history_labels(sources: list[str]) -> list[str]:
    """`turns.conversation_turns`' history sources (`turn K` or a role) in words, a tool result naming the
    turn whose call it answers."""
    out, last = [], None
    for src in sources:
        if src.startswith("turn "):
            last = src
            out.append(f"{src}: the model's own reply")
        elif src.startswith("assistant"):
            out.append("NOT a journaled turn: an assistant message from the dataset (off-policy)")
        elif src == "tool":
            out.append(f"dataset tool result, spliced in after {last}'s call" if last else "dataset tool result")
        else:
            out.append(f"dataset {src} message")
    return out


def _shared_prefix(a: list[int], earlier: list[list[int]]) -> int:
    """Longest prefix of `a` that an earlier sequence starts with."""
    best = 0
    for b in earlier:
        k = first_divergence(a, b)
        best = max(best, min(len(a), len(b)) if k is None else k)
    return best


def conversation_html(result: AuditResult, i: int, tokenizer: Any, specials: dict[int, str],
                      views: dict[Any, Any], limit: int = 400) -> tuple[str, list[str] | None]:
    """For a turn record: its conversation section (every turn in order, each turn's prompt/output ids, the
    history's sources), and the inspected turn's history labels (`history_labels`); ("", None) otherwise."""
    turn = _turns_of(result.meta.iloc[[i]])[0]
    if np.isnan(turn):
        return "", None
    m = result.meta.iloc[i]
    ds, sid, turn = str(m["dataset"]), str(m["sample_id"]), int(turn)
    head = f"<details open><summary><b>Conversation {_esc(ds)}/{_esc(sid)}</b> (turn by turn: turn {turn} inspected)"
    view, why = _journal(result, i, views)
    if view is None:
        return head + f"</summary><p><i>{_esc(why)}</i></p></details>", None
    conv = conversation_turns(view, ds, sid)
    rows, seqs, parts, sources = [], [], [], None
    for r in conv.itertuples():
        p, o = list(r.prompt_ids or []), None if r.output_ids is None else list(r.output_ids)
        shared = min(_shared_prefix(p + (o or []), seqs), len(p))
        seqs.append(p + (o or []))
        me = r.turn == turn
        if me:
            sources = history_labels(r.history.split(", ") if r.history else [])
        end = r.conversation_end if isinstance(r.conversation_end, str) else ""
        style = ' style="background:#fff8c5;font-weight:bold"' if me else ""
        rows.append(f"<tr{style}><td>{r.turn}</td><td>{_esc(r.key)}</td><td>{_esc(str(r.finish_reason))}</td>"
                    f"<td>{len(p)}</td><td>{'(none: API text)' if o is None else len(o)}</td><td>{shared}</td>"
                    f'<td style="text-align:left">{_esc(r.history)}</td><td style="text-align:left">{_esc(end)}</td>'
                    "</tr>")
        if tokenizer is not None:
            for x in set(p) | set(o or []):
                if x in getattr(tokenizer, "all_special_ids", []) and x not in specials:
                    specials[int(x)] = tokenizer.convert_ids_to_tokens(int(x))
        new = _token_spans(np.asarray(p[shared:], np.int64), tokenizer, specials, start=shared, limit=limit)
        out = ("<p><i>no output ids (an API record: 02 rebuilds them)</i></p>" if o is None else
               f'<div style="{_TOKBOX}">' + _token_spans(np.asarray(o, np.int64), tokenizer, specials, start=len(p),
                                                         limit=limit, mask=np.ones(len(o), bool)) + "</div>")
        parts.append(f"<details{' open' if me else ''}><summary>turn {r.turn}{' (inspected)' if me else ''}: "
                     f"prompt {len(p)} ids, output {'none' if o is None else f'{len(o)} ids'}</summary>"
                     f"<p style=\"font-size:12px\">prompt after the {shared} tokens it shares with an earlier turn's "
                     f"sequence (positions {shared}…{len(p) - 1}):</p><div style=\"{_TOKBOX}\">{new}</div>"
                     f'<p style="font-size:12px">output (trained):</p>{out}</details>')
    last = conv.iloc[-1] if len(conv) else None
    ended = (last["conversation_end"] if last is not None and isinstance(last["conversation_end"], str)
             else "not ended in the journal (the run may still be going)")
    table = ("<style>.e3-conv td,.e3-conv th{padding:1px 8px;border-bottom:1px solid #eee;vertical-align:top}</style>"
             '<table class="e3-conv" style="border-collapse:collapse;font-size:12px"><thead><tr><th>turn</th><th>key</th>'
             "<th>finish</th><th>prompt ids</th><th>output ids</th><th>prompt shared with an earlier turn</th>"
             "<th>history (where each message came from)</th><th>conversation end</th></tr></thead><tbody>"
             + "".join(rows) + "</tbody></table>")
    html_out = (head + f": {len(conv)} journaled turns, ended: {_esc(ended)}</summary>"
                '<p style="font-size:12px">Each turn is one record and one training sequence (its prompt ids + its '
                "output ids, loss on the output). History: <code>turn K</code> is the model's own reply of turn K "
                "(on-policy), a role is the dataset's message; the inspected turn's messages below say the same "
                "in words.</p>" + table + "".join(parts) + "</details>")
    return html_out, sources


def _turns_of(meta: Any) -> np.ndarray:
    """Per row, its turn as a float (NaN for a record without turns)."""
    if "turn" not in meta:
        return np.full(len(meta), np.nan)
    return np.array([np.nan if t is None else float(t) for t in meta["turn"].tolist()], dtype=float)


def _turn_row(result: AuditResult, dataset: str | None, sample_id: Any) -> tuple[int | None, str]:
    """A turn record's row: `sample_id` as `sid#turn` (the SampleKey spelling), or a conversation's id
    (its last turn, with a note); (None, "") when neither applies."""
    m = result.meta
    turns = _turns_of(m)
    ds_hit = (m["dataset"].astype(str) == str(dataset)).to_numpy() if dataset is not None else np.ones(len(m), bool)
    sids = m["sample_id"].astype(str).to_numpy()
    conv = np.flatnonzero(ds_hit & (sids == str(sample_id)) & ~np.isnan(turns))
    if len(conv):
        i = int(conv[np.argmax(turns[conv])])
        if len(conv) == 1:
            return i, ""
        return i, (f"sample_id {sample_id} is a conversation of {len(conv)} turns: showing its last turn "
                   f"({sample_id}#{int(turns[i])}); ask for {sample_id}#0 … for another")
    base, _, t = str(sample_id).rpartition("#")
    if base and t.isdigit():
        hit = np.flatnonzero(ds_hit & (sids == base) & (turns == int(t)))
        if len(hit):
            return int(hit[0]), ""
    return None, ""


def find_record(result: AuditResult, dataset: str | None, sample_id: Any) -> tuple[int | None, str]:
    """Row of the wanted record, else the first record, with a note saying which was shown.

    A turn record is asked for as `sample_id="sid#turn"`; a conversation's `sid` gives its last turn.
    """
    if sample_id is not None:
        i, note = _turn_row(result, dataset, sample_id)
        if i is not None:
            return i, note
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
    """One record laid out for a human: metadata, verdicts, prompt messages, output, full sequence;
    for a turn record (`sample_id="sid#turn"`) its conversation too (see the module's doc)."""
    i, note = find_record(result, dataset, sample_id)
    if i is None:
        return RecordView(f"<p><b>Inspector:</b> {_esc(note)}</p>", dataset, sample_id, False)
    found = not note or "is a conversation of" in note
    return _inspect_row(result, i, note, found, tokenizer, limit, {})


def _inspect_row(result: AuditResult, i: int, note: str, found: bool, tokenizer: Any, limit: int,
                 views: dict[Any, Any]) -> RecordView:
    """The inspector's view of row `i` (`views`: journals already read for conversation sections)."""
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
    flagged = [c for c in result.status.columns if result.status.at[i, c] == FLAG]
    provider = m.get("provider")
    provider = None if provider is None or (isinstance(provider, float) and np.isnan(provider)) else provider
    where = shown_record_path(m.get("file", ""))
    turn = _turns_of(t.meta.iloc[[i]])[0]
    sid = m["sample_id"] if np.isnan(turn) else f"{m['sample_id']}#{int(turn)}"
    head = (f'<h4 style="margin:4px 0">{_esc(str(m["dataset"]))} · sample {_esc(str(sid))}'
            + ("" if np.isnan(turn) else f" (turn {int(turn)} of conversation {_esc(str(m['sample_id']))})")
            + "</h4>"
            + (f'<p style="color:#9a6700"><b>Note:</b> {_esc(note)}</p>' if note else "")
            + f'<p style="font-size:12px">source <b>{_esc(str(m.get("source")))}</b>'
            + (f" · provider <b>{_esc(str(provider))}</b>" if provider else "")
            + f' · finish_reason <b>{_esc(str(m["finish_reason"]))}</b> · ids from '
            f'{_esc(str(m.get("ids_from", "journal")))} · prompt {len(pids)} tokens · output {len(oids)} tokens'
            + (f" · {_esc(where)}:{m.get('line', '')}" if where else "") + "<br>"
            + (f'<span style="color:#cf222e"><b>failed:</b> {_esc(", ".join(failed))}</span>' if failed
               else '<span style="color:#1a7f37"><b>no check failed</b></span>')
            + (f' · <span style="color:#9a6700"><b>flagged (kept):</b> {_esc(", ".join(flagged))}</span>'
               if flagged else "") + "</p>")
    div_html, div_at = "", None
    if tokenizer is not None and t.has_output[i]:
        div_html = divergence_html(oids, tokenizer, start=len(pids), failed="text.roundtrip" in failed + flagged)
        ids_l = [int(x) for x in oids]
        again = tokenizer.encode(tokenizer.decode(ids_l, skip_special_tokens=False), add_special_tokens=False)
        div_at = first_divergence(ids_l, again)
    count_html = _count_html(m, t.rebuilt if isinstance(t, RecordFacts) else None)
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
    conv_html, sources = conversation_html(result, i, tokenizer, specials, views)
    body = (
        head
        + conv_html
        + "<details open><summary><b>Check verdicts</b></summary>" + _verdict_table(result, i) + "</details>"
        + "<details open><summary><b>Prompt messages by role</b>"
        + (" (and where each came from)" if sources is not None else "") + "</summary>"
        + _messages_html(t.messages[i] if t.messages else None, t.tools[i] if t.tools else None, sources)
        + "</details>"
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
    return RecordView(html_out, str(m["dataset"]), sid, found)


def failing_records(result: AuditResult, tokenizer: Any = None, k: int = 3) -> list[RecordView]:
    """The first k failing (or flagged) records of each failed (or flagging) check, as inspector views."""
    views, seen, journals = [], set(), {}
    for c in result.status.columns:
        for i in np.flatnonzero(np.isin(result.status[c].to_numpy(), (FAIL, FLAG)))[:k].tolist():
            if i in seen:  # by row: a conversation's turns are records of one sample_id
                continue
            seen.add(i)
            views.append(_inspect_row(result, i, "", True, tokenizer, 800, journals))
    return views
