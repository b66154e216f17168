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
