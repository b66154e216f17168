"""The one reader of a run: one key, the record of a key by the supersede rule, exact ids before
02's rebuilt ids, malformed files named by file:line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3data.export.run import ExportError, select_samples
from eagle3data.hidden.mix import MixError, build_mix
from eagle3data.core.params import load_params
from eagle3data.core.reader import (RunFileError, SampleKey, read_jsonl, read_rebuilt, read_run, read_verdicts, resolve,
                               supersede_rule)
from runfiles import key as skey
from runfiles import make_record as _rec
from runfiles import write_jsonl as _write

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def params(tmp_path):
    """A run whose journal has a retried error, a re-journaled sample and an API record rebuilt by 02."""
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path)})
    rd = p.run_dir
    _write(rd / "records" / "b1_glaive.jsonl", [
        _rec("b1_glaive", 1, output=None, finish_reason="error", error="boom"),
        _rec("b1_glaive", 2, output=(12, 2)),
        _rec("b1_glaive", 1, output=(10, 11, 2)),  # retry of the error
        _rec("b1_glaive", 2, output=(13, 14, 2)),  # journaled again, different output: this one counts
        _rec("b1_glaive", 3, output=(20, 2)),
        _rec("b1_glaive", 3, output=None, finish_reason="error", error="late"),  # last line is an error
        _rec("b1_glaive", 4, output=None, source="api"),
    ])
    _write(rd / "records" / "b5_openthoughts.jsonl", [_rec("b5_openthoughts", 1, prompt=(7,), output=(8, 2))])
    _write(rd / "reconstruct" / "b1_glaive.jsonl", [
        {"dataset": "b1_glaive", "sample_id": 4, "source": "api", "ids_exact": False,
         "input_ids": [1, 2, 3, 40, 2], "loss_mask": [0, 0, 0, 1, 1]},
    ])
    return p


def test_the_record_of_a_key_follows_the_supersede_rule(params):
    view = read_run(params.run_dir)
    by = view.by_key()
    assert len(by) == 5
    assert by[skey("b1_glaive", "1")]["output_ids"] == [10, 11, 2]  # the retry replaced the error
    assert by[skey("b1_glaive", "2")]["output_ids"] == [13, 14, 2]  # latest of two completed lines
    assert by[skey("b1_glaive", "3")]["output_ids"] == [20, 2]  # an error after a response never replaces it
    assert view.duplicates() == {skey("b1_glaive", "2")}  # two completed lines: a real duplicate
    superseded = view.datasets["b1_glaive"].superseded()
    assert [(r["sample_id"], r["finish_reason"]) for r in superseded] == [(1, "error"), (2, "stop"), (3, "error")]
    assert [r["dataset"] for r in read_run(params.run_dir, ["b5_openthoughts"]).records()] == ["b5_openthoughts"]
    assert read_run(params.run_dir, ["absent"]).records() == []


def test_supersede_rule_one_key_per_sample_id_text():
    keys = ["1", "2", "1", "3", "3", "4", "4"]
    frs = ["error", "stop", "stop", "length", "stop", "abort", "error"]
    is_record, dup = supersede_rule(keys, frs)
    assert is_record == [False, True, True, False, True, False, True]
    assert dup == [False, False, False, False, True, False, False]


def test_sample_key_is_one_spelling():
    k = SampleKey.of({"dataset": "d", "sample_id": 7})
    assert k == skey("d", "7") == SampleKey.of({"dataset": "d", "sample_id": "7", "turn": None})
    assert str(k) == "d/7" and (k.dataset, k.sample_id, k.turn) == ("d", "7", None) and k.conversation == k


def test_sample_key_is_made_from_its_row_only():
    import pickle

    import pandas as pd

    with pytest.raises(TypeError, match=r"SampleKey.of\(row\)"):
        SampleKey("d", "7")  # no constructor from parts: a key built by hand is how a turn got dropped
    t = SampleKey.of({"dataset": "d", "sample_id": "a#1", "turn": 2})  # a sample_id may hold '#'
    assert str(t) == "d/a#1#2" and (t.sample_id, t.turn) == ("a#1", 2) and str(t.conversation) == "d/a#1"
    assert pickle.loads(pickle.dumps(t)).turn == 2
    # a table row (pandas: a NaN turn in a column that holds turns elsewhere is no turn), a Sample, a key
    frame = pd.DataFrame({"dataset": ["d", "d"], "sample_id": ["5", "6"], "turn": [1, None]})
    assert [str(SampleKey.of(r)) for _, r in frame.iterrows()] == ["d/5#1", "d/6"]
    assert SampleKey.of_frame(frame) == ["d/5#1", "d/6"]
    assert SampleKey.of(resolve(_rec("d", 5, prompt=(1,), output=(2,)) | {"turn": 3}, {})) == "d/5#3"
    with pytest.raises(KeyError, match="sample_id"):
        SampleKey.of({"dataset": "d"})


def test_resolve_exact_then_rebuilt_then_none(params):
    rebuilt = read_rebuilt(params.run_dir)
    s = resolve(_rec("b1_glaive", 9, prompt=(1, 2), output=(3, 2)), rebuilt)
    assert (s.input_ids, s.loss_mask, s.ids_exact, s.sample_id, s.key, str(s.key)) == \
        ([1, 2, 3, 2], [0, 0, 1, 1], True, "9", skey("b1_glaive", "9"), "b1_glaive/9")
    assert s.record is None and resolve(_rec("b1_glaive", 9), rebuilt, keep_record=True).record is not None
    api = resolve(_rec("b1_glaive", 4, output=None, source="api"), rebuilt)
    assert (api.input_ids, api.loss_mask, api.ids_exact, api.source) == ([1, 2, 3, 40, 2], [0, 0, 0, 1, 1], False, "api")
    assert resolve(_rec("b1_glaive", 5, output=None, source="api"), rebuilt) is None
    # exact ids win over a rebuilt line for the same key
    assert resolve(_rec("b1_glaive", 4, prompt=(1,), output=(2,)), rebuilt).input_ids == [1, 2]


def test_export_takes_exactly_the_mix(params):
    mix = build_mix(params, write=False)
    sel = select_samples(params)
    assert [(s.key, s.input_ids, s.loss_mask, s.ids_exact) for s in sel.samples] == \
        [(s.key, s.input_ids, s.loss_mask, s.ids_exact) for s in mix.samples]
    as_mix = {str(s.key): s.input_ids for s in mix.samples}
    assert as_mix["b1_glaive/1"] == [1, 2, 3, 10, 11, 2] and as_mix["b1_glaive/3"] == [1, 2, 3, 20, 2]
    assert "b1_glaive/2" not in as_mix  # a real duplicate
    assert sorted((d["sample_id"], d["reason"]) for d in mix.dropped) == [
        ("1", "superseded"), ("2", "duplicate_key"), ("2", "superseded"), ("3", "superseded")]
    assert sel.skipped == mix.dropped


def test_read_verdicts_by_key_or_none(tmp_path):
    assert read_verdicts(tmp_path) is None
    _write(tmp_path / "audit" / "verdicts.jsonl", [{"dataset": "d", "sample_id": 7, "failed": ["x"], "truncated": True}])
    assert read_verdicts(tmp_path) == {skey("d", "7"): {"dataset": "d", "sample_id": 7, "failed": ["x"], "truncated": True}}
    _write(tmp_path / "audit" / "verdicts.jsonl", [{"dataset": "d", "failed": []}])
    with pytest.raises(RunFileError, match=r"verdicts\.jsonl:1: missing field\(s\) sample_id") as e:
        read_verdicts(tmp_path)
    assert e.value.fields == ("sample_id",) and e.value.line == 1


def test_read_rebuilt_rejects_malformed_lines(tmp_path):
    path = tmp_path / "reconstruct" / "d.jsonl"
    _write(path, [{"dataset": "d", "sample_id": 1, "input_ids": [1, 2], "loss_mask": [1]}])
    with pytest.raises(RunFileError, match=r"d\.jsonl:1: field `loss_mask` has 1 entries for 2 input_ids"):
        read_rebuilt(tmp_path)
    _write(path, [{"dataset": "d", "sample_id": 1, "input_ids": "12", "loss_mask": [1]}])
    with pytest.raises(RunFileError, match="must be lists"):
        read_rebuilt(tmp_path, ["d"])
    assert read_rebuilt(tmp_path, ["other"]) == {}
    # each consumer gets its own error class, one wording
    _write(path, [{"dataset": "d", "sample_id": 1}])
    with pytest.raises(MixError, match=r"d\.jsonl:1: missing field\(s\) input_ids, loss_mask"):
        read_rebuilt(tmp_path, error=MixError)
    with pytest.raises(ExportError, match=r"d\.jsonl:1: missing field\(s\) input_ids, loss_mask"):
        read_rebuilt(tmp_path, error=ExportError)


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}')  # blank line skipped; complete last line without newline is kept
    assert list(read_jsonl(path)) == [(1, {"a": 1}), (3, {"a": 2})]
    path.write_bytes(b'{"a": 1}\n{"a": ')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: not JSON .*the line is cut off"):
        list(read_jsonl(path))
    path.write_bytes(b'nope\n{"a": 1}\n')
    with pytest.raises(RunFileError, match=r"x\.jsonl:1: not JSON") as e:
        list(read_jsonl(path))
    assert "cut off" not in str(e.value)


def test_rebuilt_turns_keep_their_own_key(smollm2_tokenizer):
    """02's line of an API turn carries the turn, so two turns of one conversation stay two samples."""
    from eagle3data.core.params import ReconstructParams
    from eagle3data.core.profiles import SMOLLM2
    from eagle3data.rebuild.run import reconstruct_records
    from runfiles import synthetic_api_record

    recs = [dict(synthetic_api_record("d", 5, reasoning=None, content=f"Answer {t}.", profile="smollm2",
                                      completion_tokens=4), turn=t) for t in (0, 1)]
    lines = reconstruct_records(recs, smollm2_tokenizer, SMOLLM2, ReconstructParams())
    assert [SampleKey.of(ln) for ln in lines] == [skey("d", "5", 0), skey("d", "5", 1)]
    assert len({SampleKey.of(ln) for ln in lines}) == 2
