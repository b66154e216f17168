"""The report's pieces without a browser: banners, the informative check matrix, percentages, paths, plots."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

REPO = Path(__file__).resolve().parents[1]


def _journal(path: Path, recs: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    return path


def _rec(sid, output, dataset="d", **kw) -> dict:
    return {"dataset": dataset, "sample_id": sid, "source": "local", "finish_reason": "stop",
            "prompt_ids": [1, 9, 10], "output_ids": output} | kw


def _result(tmp_path: Path, recs: list[dict], ledger: dict | None = None):
    from eagle3data.audit.run import audit_table
    from eagle3data.audit.idtable import read_journal
    from eagle3data.core.profiles import SMOLLM2

    res = audit_table(read_journal(_journal(tmp_path / "records" / "d.jsonl", recs)), SMOLLM2)
    res.ledger = ledger
    return res


def test_zero_records_is_a_banner_not_a_clean_bill(tmp_path):
    from eagle3data.audit.report import audit_banners

    html = audit_banners(_result(tmp_path, [], {"datasets": {"d": {"planned": 5, "done": 0}}})).html
    assert "Zero records" in html and "e3-banner-error" in html
    assert "No record failed a check" not in html


def test_rejected_prompt_lines_and_failed_checks_banners(tmp_path):
    from eagle3data.audit.report import audit_banners, ledger_banners

    led = {"datasets": {"d": {"planned": 3, "done": 3, "rejected_prompt_lines": [
        "p.jsonl:2: not JSON", "p.jsonl:5: no messages", "p.jsonl:7: no messages", "p.jsonl:9: cut off"]}}}
    res = _result(tmp_path, [_rec(1, [5, 6, 2]), _rec(2, [5, 7, 2]), _rec(3, [5, 8])], led)  # 3: no end-of-turn
    html = audit_banners(res).html
    assert "4 prompt line(s) were rejected" in html and "p.jsonl:2: not JSON" in html and "p.jsonl:7" in html
    assert "p.jsonl:9" not in html  # the first three only
    assert "1 of 3 records failed at least one check" in html and "output.ends_with_eot: 1 record(s)" in html
    assert "not run" in html  # no tokenizer: its checks are named as not run
    assert ledger_banners({"datasets": {"d": {"done": 2}}}) == []  # nothing to warn about


def test_clean_audit_says_so(tmp_path, smollm2_tokenizer):
    from eagle3data.audit.run import audit_table
    from eagle3data.audit.idtable import read_journal
    from eagle3data.core.profiles import SMOLLM2
    from eagle3data.audit.report import audit_banners

    enc = lambda s: smollm2_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    msgs = [{"role": "user", "content": "Hi."}]
    prompt = enc(smollm2_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    path = _journal(tmp_path / "records" / "d.jsonl", [_rec(i, enc(f"Answer {i}.") + [2], prompt_ids=prompt,
                                                            messages=msgs) for i in range(3)])
    res = audit_table(read_journal(path, source_fields=True), SMOLLM2, tokenizer=smollm2_tokenizer, roundtrip=True)
    res.ledger = {"datasets": {"d": {"done": 3}}}
    html = audit_banners(res).html
    assert "e3-banner-ok" in html and "No record failed a check (3 records" in html


def test_export_banners():
    from eagle3data.audit.report import export_banners

    def res(sel, exported=5):
        return SimpleNamespace(manifests={"specforge": {"selection": sel, "exported": exported}})

    assert "Unaudited export" in export_banners(res({"verdicts_present": False})).html
    assert "failed audit checks" in export_banners(res({"verdicts_present": True, "include_failed": True})).html
    assert "Zero records exported" in export_banners(res({"verdicts_present": True}, exported=0)).html
    assert export_banners(res({"verdicts_present": True, "include_failed": False})).html == ""


def test_check_matrix_shows_only_informative_cells(tmp_path):
    from eagle3data.audit.report import check_matrix_html

    recs = [_rec(i, [5, 6 + i, 2]) for i in range(4)] + [_rec(9, [5, 6])]
    html = check_matrix_html(_result(tmp_path, recs)).html
    assert 'class="dataframe check-matrix"' in html and "overflow-x:auto" in html
    assert "FAIL 1/5 (20.0%)" in html  # output.ends_with_eot, the one that failed
    assert "(&lt;100.0%)" not in html and "(<100.0%)" not in html  # no per-cell bound noise
    assert "<th>output.single_reasoning_close</th>" not in html  # n/a for this profile: not a column
    assert "<th>output.ids_in_vocab</th>" not in html  # passed everywhere: folded into the last column
    assert "passed; weakest bound 0/5 (&lt;60.0%)" in html  # one compact bound for the group (3/5)


def test_check_summary_upper95_as_percentage(tmp_path):
    from eagle3data.audit.report import check_summary_view

    v = check_summary_view(_result(tmp_path, [_rec(i, [5, 6 + i, 2]) for i in range(50)]))
    assert v.loc["output.ends_with_eot", "upper95"] == "6.00%"  # 3/50, like the verdict's "(< 6.00%)"
    assert "< 6.00%" in v.loc["output.ends_with_eot", "verdict"]
    assert v.loc["output.ends_with_eot", "records_for_0.1%"] == "3,000"


def test_paths_are_relative(tmp_path):
    from eagle3data.audit.inspector import shown_record_path
    from eagle3data.audit.report import shown_path

    assert shown_path(REPO / "outputs" / "x" / "records" / "a.jsonl") == "outputs/x/records/a.jsonl"
    assert shown_path(tmp_path / "run" / "records" / "a.jsonl", tmp_path / "run") == "records/a.jsonl"
    assert shown_path("/somewhere/else/runs/r1") == "…/runs/r1"
    assert shown_record_path("/abs/path/run/records/b1.jsonl") == "records/b1.jsonl"


def test_whitespace_token_markers():
    from eagle3data.audit.inspector import first_divergence, token_html

    assert token_html("\n    ") == '<span class="e3-ws">\u21b5\n\u00b7\u00b7\u00b7\u00b7</span>'
    assert token_html(" ") == '<span class="e3-ws">\u00b7</span>'
    assert token_html(" if") == " if"  # a word keeps its leading space
    assert token_html("}\n") == '}<span class="e3-ws">\u21b5\n</span>'
    assert token_html("") == '<span class="e3-ws">\u2205</span>' and token_html("<a>") == "&lt;a&gt;"
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 4, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("fn", ["length_distributions", "special_positions", "finish_reasons", "check_failures"])
def test_plot_legends_outside_and_integer_count_ticks(tmp_path, fn):
    import matplotlib

    matplotlib.use("Agg")
    from eagle3data.audit import plots

    recs = [_rec(i, [5] * (3 + i) + [2]) for i in range(6)] + [_rec(7, [5] * 9, finish_reason="length")]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = getattr(plots, fn)(_result(tmp_path, recs + [_rec(8, [5, 6])]))
    FigureCanvasAgg(fig).draw()
    legends = [lg for ax in fig.axes for lg in ([ax.get_legend()] if ax.get_legend() else [])] + list(fig.legends)
    assert legends, fn
    r = fig.canvas.get_renderer()
    for ax in fig.axes:
        box = ax.get_window_extent(r)
        for lg in legends:
            lb = lg.get_window_extent(r)
            assert not box.overlaps(lb), (fn, "legend over the plot area")
    count_axes = {"length_distributions": "y", "finish_reasons": "x", "check_failures": "x", "special_positions": "y"}
    for ax in fig.axes:
        ticks = (ax.get_yticks() if count_axes[fn] == "y" else ax.get_xticks())
        assert all(float(t).is_integer() for t in ticks), (fn, ticks)


def test_superseded_lines_table(tmp_path):
    from eagle3data.audit.report import superseded_html

    err = {"dataset": "d", "sample_id": 1, "source": "local", "finish_reason": "error", "error": "HTTP 502"}
    res = _result(tmp_path, [err, _rec(1, [5, 6, 2]), _rec(2, [5, 7, 2])])
    html = superseded_html(res).html
    assert "Superseded journal lines (1)" in html and "records/d.jsonl" in html and str(tmp_path) not in html
    assert res.summary()["records_failed"] == 0  # a retried error is not a failure
    assert superseded_html(_result(tmp_path / "b", [_rec(1, [5, 6, 2])])).html == ""


def summary_run(run_dir: Path, *, verify_ok: bool = True, value: bool = True) -> Path:
    """A run folder holding what the stages write (01's ledger, 03's summary, 04's mix and verification, 05's
    manifest, 06's τ) and an executed-looking 03 notebook with its sections and a notebook-only notes cell."""
    import json

    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    def put(rel: str, data: dict) -> None:
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(json.dumps(data))

    for stage in ("01_generate", "03_audit", "04_extract_hidden", "05_export") + (("06_value",) if value else ()):
        put(f"provenance/{stage}.json", {"stage": stage})
    put("ledger.json", {"datasets": {"b1_glaive": {"done": 3, "prompt_tokens": 900, "completion_tokens": 300,
                                                   "cost_usd": 1.25},
                                     "b2_code": {"done": 2, "prompt_tokens": 100, "completion_tokens": 50,
                                                 "cost_usd": 0.5}}})
    check = {"what": "w", "not_applicable": 0, "not_run": 0}
    put("audit/summary.json", {
        "records": 5, "records_failed": 1, "records_truncated": 2,
        "checks": {"output.ends_with_eot": check | {"applicable": 5, "failed": 1, "upper95": None, "verdict": "FAIL 1/5"},
                   "record.complete": check | {"applicable": 5, "failed": 0, "upper95": 0.6, "verdict": "0/5"},
                   "prompt.tools_present": check | {"applicable": 2, "failed": 0, "upper95": 1.0, "verdict": "0/2"}},
        "groups": [{"dataset": "b1_glaive", "records": 3, "prompt_tokens": 901, "output_tokens": 299, "failed": 1},
                   {"dataset": "b2_code", "records": 2, "prompt_tokens": 100, "output_tokens": 50, "failed": 0}]})
    put("hidden/mix_manifest.json", {"datasets": {"b1_glaive": {"samples": 2, "tokens": 800, "loss_tokens": 200},
                                                  "b2_code": {"samples": 2, "tokens": 150, "loss_tokens": 50}}})
    vcheck = {"what": "w"}
    put("hidden/verify_summary.json", {
        "ok": verify_ok, "samples": 4, "failed_samples": 0 if verify_ok else 1, "tokens": 950, "positions": 64,
        "recomputed": 2, "norm_profile": "ok", "states": ["aux_0", "final"], "dtype": "bfloat16", "layout": "shards",
        "store_problems": [], "head": {},
        "checks": {"head_logit": vcheck | {"applicable": 4, "failed": 0 if verify_ok else 1, "upper95": 0.75},
                   "finite": vcheck | {"applicable": 4, "failed": 0, "upper95": 0.75}}})
    put("export/speculators/manifest.json", {"exported": 4, "tokens": 950,
                                             "selection": {"hidden_verification": "passed"}})
    if value:
        f = {"prompts": 164, "tau_engine": 1.3, "tau_engine_ci95": [1.28, 1.32], "tau_offline": 1.36,
             "tau_offline_ci95": [1.33, 1.4], "per_position": [0.23, 0.059, 0.012], "lossless": True}
        put("value/summary.json", {"eval": {"num_speculative_tokens": 3}, "variants": [
            {"variant": "exact", "per_dataset": {"humaneval": f, "heldout": f | {"tau_engine": 1.53,
                                                                                "tau_engine_ci95": [1.48, 1.59]}}}]})
    cells = [new_markdown_cell("# 03 · Audit\nWhat the stage does."),
             new_markdown_cell("**Reads:** records. **Writes:** verdicts. **Parameters:** params_file.",
                               metadata={"tags": ["notebook-only"]}),
             new_markdown_cell("## 2. Ledger: the damage assessment"),
             new_code_cell("x", outputs=[new_output("execute_result", execution_count=1,
                                                    data={"text/html": "<p>LEDGER-TABLE</p>", "text/plain": "x"})]),
             new_markdown_cell("## 3. Checks: honest numbers")]
    (run_dir / "notebooks").mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=cells), str(run_dir / "notebooks" / "03_audit.ipynb"))
    return run_dir


def test_report_opens_on_the_run_summary(tmp_path):
    """report.html starts with the run's summary (per dataset, cost, audit verdict and bounds, states verified, τ),
    linking to sections that exist; the notebook-only notes stay out."""
    import re

    from eagle3data.audit.report import render_report

    text = render_report(summary_run(tmp_path / "myrun")).read_text(encoding="utf-8")
    top = text.index('id="e3-summary"')
    assert top < text.index('<div class="jp-Cell') < text.index("LEDGER-TABLE")  # above the first notebook cell
    summary = text[top:text.index('<div class="jp-Cell')]
    assert "<title>myrun · report</title>" in text and "Run myrun" in summary
    assert "<td>b1_glaive</td><td>3</td><td>901</td><td>299</td><td>$1.25</td><td>1</td><td>2</td><td>800</td>" in summary
    assert "<td><b>5</b></td><td><b>1,001</b></td>" in summary  # the totals row
    assert "$1.75" in summary  # the run's cost
    assert "1 of 5 records failed a check (output.ends_with_eot 1/5)" in summary
    assert "the other 2 applicable checks passed, each failure rate below 100.00% at 95%" in summary
    assert "2 records truncated" in summary
    assert "passed: no stored sample failed (4 samples, 950 tokens)" in summary
    assert "speculators 4 samples, 950 tokens" in summary
    assert "humaneval <b>1.3</b> (1.28–1.32)" in summary and "heldout <b>1.53</b> (1.48–1.59)" in summary
    links = re.findall(r'href="#([^"]+)"', summary)
    assert {"e3-verify", "e3-value"} <= set(links) and any(x.startswith("2.-Ledger") for x in links)
    for anchor in links:  # every link lands on an element of the page
        assert f'id="{anchor}"' in text, anchor
    assert "Reads:" not in text and "Parameters:" not in text  # notebook-only: left out of the report


def test_summary_says_what_failed_and_leaves_out_stages_that_did_not_run(tmp_path):
    from eagle3data.audit.report import render_report

    text = render_report(summary_run(tmp_path / "r", verify_ok=False, value=False)).read_text(encoding="utf-8")
    summary = text[text.index('id="e3-summary"'):text.index('<div class="jp-Cell')]
    assert "<b>failed</b>: 1 of 4 stored samples (head_logit 1)" in summary
    assert "τ" not in summary and "e3-value" not in text
