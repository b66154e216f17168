"""The shareable report, checked in a real browser: plots are images that loaded, the check table is there.

The run summary opens the page, above the first notebook section (its links land on the sections).
Runs headless Chromium (Debian package `chromium`) with `--dump-dom` on a copy of the report
into which a small script is injected: on the page's load event it writes, into a
`<pre id="e3-browser-check">`, each image's `complete`/`naturalWidth`/`naturalHeight` and the
number of `table.check-table` elements (the marker the 03_audit notebook puts on its check
table). External hosts are mapped to NOTFOUND, so the page's CDN scripts fail at once and the
check never touches the network. Skipped, with the reason, where Chromium is not installed.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "e3-browser-check"
PROBE = (
    "<script>window.addEventListener('load',function(){var r={images:Array.from(document.images)"
    ".map(function(i){return {complete:i.complete,width:i.naturalWidth,height:i.naturalHeight,"
    "src:(i.getAttribute('src')||'').slice(0,40)}}),"
    "check_tables:document.querySelectorAll('table.check-table').length,"
    "check_table_rows:Array.from(document.querySelectorAll('table.check-table tbody tr')).length};"
    "var p=document.createElement('pre');p.id='" + MARKER + "';p.textContent=JSON.stringify(r);"
    "document.body.appendChild(p);});</script>"
)


def chromium_binary() -> str | None:
    """Chromium to use: $CHROMIUM, else `chromium` / `chromium-browser` on PATH, else /usr/bin/chromium."""
    for cand in (os.environ.get("CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser"),
                 "/usr/bin/chromium"):
        if cand and Path(cand).exists():
            return cand
    return None


needs_chromium = pytest.mark.skipif(
    chromium_binary() is None,
    reason="headless Chromium not installed (Debian: apt-get install -y chromium; or set $CHROMIUM)",
)


def browser_check(page: Path, workdir: Path, probe: str = PROBE) -> dict:
    """Load `page` in headless Chromium; return what the injected probe saw (images, check tables)."""
    probe_page = workdir / "probed.html"
    text = page.read_text(encoding="utf-8")
    probe_page.write_text(text.replace("</body>", probe + "</body>") if "</body>" in text else text + probe,
                          encoding="utf-8")
    cmd = [chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--no-first-run", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={workdir / 'chromium-profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--virtual-time-budget=10000", "--dump-dom", probe_page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(rf'<pre id="{MARKER}">(.*?)</pre>', proc.stdout, re.S)
    assert m, (f"the probe did not report (chromium exit {proc.returncode}); "
               f"stderr tail:\n{proc.stderr[-2000:]}")
    return json.loads(html.unescape(m.group(1)))


def _png_bytes() -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.bar(["pass", "fail"], [3, 1])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _fake_audit_run(run_dir: Path) -> Path:
    """A run folder holding an executed-looking 03_audit notebook: one plot, one check table."""
    import nbformat
    import pandas as pd
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    table = pd.DataFrame({"check": ["ends_with_end_of_turn", "roundtrip"], "failed": [0, 1], "n": [4, 4]})
    cells = [
        new_markdown_cell("# 03 · Audit"),
        new_code_cell("plot()", outputs=[new_output("display_data", data={
            "image/png": base64.b64encode(_png_bytes()).decode(), "text/plain": "<Figure>"})]),
        new_code_cell("table", outputs=[new_output("execute_result", execution_count=1, data={
            "text/html": table.to_html(classes="check-table", index=False), "text/plain": table.to_string()})]),
    ]
    nb = new_notebook(cells=cells)
    (run_dir / "notebooks").mkdir(parents=True)
    nbformat.write(nb, str(run_dir / "notebooks" / "03_audit.ipynb"))
    return run_dir


# Where the run summary sits once laid out: its top against the first notebook cell's and the first notebook
# heading's, whether each of its links lands on an element of the page, and the page's visible text.
SUMMARY_PROBE = (
    "<script>window.addEventListener('load',function(){"
    "var s=document.getElementById('e3-summary');"
    "var cell=document.querySelector('div.jp-Cell');"
    "var head=document.querySelector('div.jp-Cell h1, div.jp-Cell h2');"
    "var top=function(e){return e?e.getBoundingClientRect().top+window.scrollY:null;};"
    "var links=s?Array.from(s.querySelectorAll('a[href^=\"#\"]')).map(function(a){"
    "var id=decodeURIComponent(a.getAttribute('href').slice(1));"
    "return {id:id,found:document.getElementById(id)!==null,text:a.textContent}}):[];"
    "var r={summary_top:top(s),summary_height:s?s.getBoundingClientRect().height:0,first_cell_top:top(cell),"
    "first_heading_top:top(head),links:links,summary_text:s?s.innerText:'',text:document.body.innerText};"
    "var p=document.createElement('pre');p.id='" + MARKER + "';p.textContent=JSON.stringify(r);"
    "document.body.appendChild(p);});</script>"
)


def assert_summary_on_top(seen: dict) -> None:
    """The run summary is shown above the first notebook cell and heading; every link of it lands on the page."""
    assert seen["summary_top"] is not None, "no run summary (#e3-summary) in the report"
    assert seen["summary_height"] > 0
    assert seen["summary_top"] + seen["summary_height"] <= seen["first_cell_top"], seen
    assert seen["first_heading_top"] is None or seen["summary_top"] < seen["first_heading_top"], seen
    assert seen["links"] and all(a["found"] for a in seen["links"]), seen["links"]
    assert "Reads:" not in seen["text"] and "Writes:" not in seen["text"]  # notebook-only notes stay out


@needs_chromium
def test_probe_tells_a_loaded_plot_from_a_broken_one(tmp_path):
    """The harness itself: a real PNG loads (naturalWidth > 0), a corrupt one does not, tables are counted."""
    good = base64.b64encode(_png_bytes()).decode()
    page = tmp_path / "page.html"
    page.write_text(
        "<html><body>"
        f'<img src="data:image/png;base64,{good}">'
        '<img src="data:image/png;base64,bm90IGEgcG5n">'
        '<table class="check-table"><tbody><tr><td>x</td></tr></tbody></table>'
        "</body></html>", encoding="utf-8")
    seen = browser_check(page, tmp_path)
    widths = [i["width"] for i in seen["images"]]
    assert widths[0] > 0 and widths[1] == 0
    assert seen["check_tables"] == 1


@needs_chromium
def test_rendered_report_shows_loaded_plots_and_the_check_table(tmp_path):
    """`render_report` output (code hidden, images inlined) loads its plots and keeps the check table."""
    from eagle3data.audit.report import render_report

    report = render_report(_fake_audit_run(tmp_path / "run"))
    seen = browser_check(report, tmp_path)
    assert seen["images"], "no image in the report"
    assert all(i["complete"] and i["width"] > 0 for i in seen["images"]), seen["images"]
    assert seen["check_tables"] == 1 and seen["check_table_rows"] == 2


@needs_chromium
@pytest.mark.skipif(not (REPO / "notebooks" / "03_audit.ipynb").exists(),
                    reason="notebooks/03_audit.ipynb does not exist yet (stage 03 not built)")
def test_audit_report_of_a_real_run_in_the_browser(ci_run, tmp_path):
    """Stage 03 on the small CI run, then its report.html in Chromium: every plot loaded, check table present."""
    root = tmp_path / "runs"
    shutil.copytree(ci_run.run_dir, root / ci_run.run_name)
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3data", "run", str(REPO / "params" / "ci.yaml"), "-p", "output_root", str(root),
         "--only", "02", "--only", "03"] if (REPO / "notebooks" / "02_reconstruct.ipynb").exists() else
        [sys.executable, "-m", "eagle3data", "run", str(REPO / "params" / "ci.yaml"), "-p", "output_root", str(root),
         "--only", "03"],
        cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = root / ci_run.run_name / "report.html"
    assert report.exists()
    seen = browser_check(report, tmp_path)
    assert seen["images"], "the audit report has no plot"
    assert all(i["complete"] and i["width"] > 0 for i in seen["images"]), seen["images"]
    assert seen["check_tables"] >= 1, "no <table class='check-table'> in the audit report"
    top = browser_check(report, tmp_path, SUMMARY_PROBE)  # the run summary opens the page, above the notebook
    assert_summary_on_top(top)
    assert "Records and tokens per dataset" in top["summary_text"] and "Audit (03)" in top["summary_text"]
    assert {a["text"] for a in top["links"]} >= {"Cost (01)", "Audit (03)"}


@needs_chromium
def test_run_summary_above_the_notebook_in_the_browser(tmp_path):
    """A run where 01, 03, 04, 05 and 06 wrote their files: the summary is above the first notebook section,
    with τ and the verification linked to their sections, and those sections are on the page."""
    from test_report import summary_run

    from eagle3data.audit.report import render_report

    seen = browser_check(render_report(summary_run(tmp_path / "run")), tmp_path, SUMMARY_PROBE)
    assert_summary_on_top(seen)
    text = seen["summary_text"]
    assert "States verified (04)" in text and "What the data is worth (06)" in text and "1.53 (1.48–1.59)" in text
    assert {a["id"] for a in seen["links"]} >= {"e3-verify", "e3-value"}


# What the inspector's token boxes look like once laid out: the whitespace-only tokens (those
# holding a `.e3-ws` marker) with their rendered text and width, how many ordinary tokens the
# browser split over two lines, how many lines the wrapped box has, and the page's visible text.
TOKEN_PROBE = (
    "<script>window.addEventListener('load',function(){"
    "var toks=Array.from(document.querySelectorAll('span.e3-tok'));"
    "var ws=toks.filter(function(t){return t.querySelector('.e3-ws')!==null;}).map(function(t){"
    "return {text:t.innerText,width:t.getBoundingClientRect().width,title:t.getAttribute('title')}});"
    "var broken=toks.filter(function(t){return t.textContent.indexOf('\\n')<0 && t.getClientRects().length>1;})"
    ".map(function(t){return t.getAttribute('title')});"
    "var tops={};toks.forEach(function(t){tops[Math.round(t.getBoundingClientRect().top)]=1;});"
    "var r={tokens:toks.length,ws:ws,broken:broken,lines:Object.keys(tops).length,"
    "outlined:document.querySelectorAll('span.e3-tok.e3-div').length,"
    "matrix_scroll:Array.from(document.querySelectorAll('table.check-matrix')).map(function(t){"
    "return getComputedStyle(t.parentElement).overflowX}),"
    "text:document.body.innerText};"
    "var p=document.createElement('pre');p.id='" + MARKER + "';p.textContent=JSON.stringify(r);"
    "document.body.appendChild(p);});</script>"
)


def _whitespace_run(run_dir: Path, tok) -> Path:
    """A run folder whose executed-looking 03 notebook holds the inspector on code with indentation tokens.

    Record 1: output `def f(x):\\n    if x: ...` (tokens '\\n   ', '\\n       ', ' ' hold only
    whitespace) plus a long line, so the box wraps. Record 2: `hello` split into two tokens
    (`hel` + `lo`), so decode->encode diverges. Also a check matrix, the banners, and a
    figures cell tagged `hide-from-html` that must not reach the page.
    """
    import nbformat
    import orjson
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    from eagle3data.audit.checks import FLAG
    from eagle3data.audit.run import audit_table
    from eagle3data.audit.idtable import read_journal
    from eagle3data.audit.inspector import inspect_record
    from eagle3data.core.profiles import SMOLLM2
    from eagle3data.audit.report import HIDE_TAG, audit_banners, check_matrix_html

    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompt = enc(tok.apply_chat_template([{"role": "user", "content": "Write f."}], add_generation_prompt=True,
                                         tokenize=False))
    code = "def f(x):\n    if x:\n        return 1\n" + " ".join(f"word{i}" for i in range(160)) + "\n"
    out1 = enc(code) + [2]
    out2 = enc("Say ") + enc("hel") + enc("lo") + [2]
    (run_dir / "records").mkdir(parents=True)
    recs = [{"dataset": "code", "sample_id": sid, "source": "local", "finish_reason": "stop", "prompt_ids": prompt,
             "output_ids": o, "messages": [{"role": "user", "content": "Write f."}]}
            for sid, o in ((1, out1), (2, out2))]
    (run_dir / "records" / "code.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    result = audit_table(read_journal(run_dir / "records" / "code.jsonl", source_fields=True), SMOLLM2, tokenizer=tok)
    assert result.status.at[1, "text.roundtrip"] == FLAG  # record 2 fails the roundtrip (the split `hello`): a flag

    def html_cell(h: str, **meta) -> Any:
        c = new_code_cell("x", outputs=[new_output("execute_result", execution_count=1,
                                                   data={"text/html": h, "text/plain": "<HTML block>"})])
        c.metadata.update(meta)
        return c

    cells = [new_markdown_cell("# 03 · Audit"), html_cell(audit_banners(result).html),
             html_cell(check_matrix_html(result).html),
             html_cell(inspect_record(result, "code", 1, tok).html), html_cell(inspect_record(result, "code", 2, tok).html),
             new_markdown_cell("## Figures recorded for tests", metadata={"tags": [HIDE_TAG]}),
             html_cell("<p>FIGURES-FOR-TESTS {'records': 2}</p>", tags=[HIDE_TAG])]
    (run_dir / "notebooks").mkdir()
    nbformat.write(new_notebook(cells=cells), str(run_dir / "notebooks" / "03_audit.ipynb"))
    return run_dir


@needs_chromium
def test_whitespace_tokens_stay_visible_and_tokens_never_break_in_the_browser(tmp_path, smollm2_tokenizer):
    """The report in Chromium: indentation tokens visible (markers, width), no token split over two lines,
    the roundtrip divergence named and outlined, the matrix scrolls, no figures-for-tests, no absolute path."""
    from eagle3data.audit.report import render_report

    run_dir = _whitespace_run(tmp_path / "run", smollm2_tokenizer)
    report = render_report(run_dir)
    raw = report.read_text(encoding="utf-8")
    seen = browser_check(report, tmp_path, TOKEN_PROBE)
    ws = {w["text"] for w in seen["ws"]}
    assert "\u21b5\n\u00b7\u00b7\u00b7" in ws, ws  # '\\n   ': newline marker, then three visible spaces
    assert "\u21b5\n" + "\u00b7" * 7 in ws, ws  # '\\n       ': the deeper indentation
    assert "\u00b7" in ws, ws  # the lone ' ' before 1
    assert all(w["width"] > 0 for w in seen["ws"]), seen["ws"]
    assert seen["lines"] > 3 and seen["broken"] == [], seen["broken"]  # wrapped, but only between tokens
    text = seen["text"]
    assert "decode\u2192encode diverges at output position 1 " in text, text[-3000:]  # 'Say',' ' vs 'Say',' hello'
    assert "re-encoding gives" in text and "re-encoded token" in text  # both sides, ids and tokens
    assert seen["outlined"] == 2  # the divergent token, in the decoded output and in the full sequence
    assert "flagged 1/2" in text and seen["matrix_scroll"] == ["auto"]
    assert "records flagged (audit.flag_only)" in text  # the banner
    assert "FIGURES-FOR-TESTS" not in raw and "Figures recorded for tests" not in raw
    assert "records/code.jsonl" in text and str(tmp_path) not in raw  # relative to the run folder
    assert "provider None" not in text and "word-break:break-all" not in raw
