"""Training mix (04's input): audit filter, rebuilt ids for API records, duplicates, caps, seeded shuffle."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3data.mix import MixError, build_mix, read_mix
from eagle3data.params import load_params
from runfiles import make_record as _rec
from runfiles import write_jsonl as _write

REPO = Path(__file__).resolve().parents[1]


def _params(root: Path, **over):
    return load_params(REPO / "params" / "ci.yaml", {"output_root": str(root), **over})


@pytest.fixture
def run(tmp_path):
    p = _params(tmp_path)
    rd = p.run_dir
    _write(rd / "records" / "b1_glaive.jsonl", [
        _rec("b1_glaive", 1, output=(10, 11, 2)),
        _rec("b1_glaive", 2, output=(12, 2)),
        _rec("b1_glaive", 3, output=None, source="api"),  # API record, rebuilt by 02
        _rec("b1_glaive", 4, output=None, source="api"),  # API record, 02 has no line for it
        _rec("b1_glaive", 5, output=None, finish_reason="error", error="boom"),
        _rec("b1_glaive", 1, output=(10, 11, 2)),  # same key completed again: a real duplicate
    ])
    _write(rd / "records" / "b5_openthoughts.jsonl", [
        _rec("b5_openthoughts", 7, prompt=(20, 21), output=(22, 2)),
        _rec("b5_openthoughts", 8, prompt=(1, 2, 3), output=(12, 2)),  # same ids as b1_glaive/2
        _rec("b5_openthoughts", 9, prompt=(30,), output=(31, 32, 2), finish_reason="length"),
    ])
    _write(rd / "reconstruct" / "b1_glaive.jsonl", [
        {"dataset": "b1_glaive", "sample_id": 3, "source": "api", "ids_exact": False,
         "input_ids": [1, 2, 3, 40, 41, 2], "loss_mask": [0, 0, 0, 1, 1, 1]},
    ])
    return p


def _keys(mix) -> set[str]:
    return {s.key for s in mix.samples}


def test_exact_and_rebuilt_ids_and_drop_reasons(run):
    mix = build_mix(run)
    by = {s.key: s for s in mix.samples}
    assert _keys(mix) == {"b1_glaive/2", "b1_glaive/3", "b5_openthoughts/7", "b5_openthoughts/9"}
    s = by["b1_glaive/2"]
    assert s.input_ids == [1, 2, 3, 12, 2] and s.loss_mask == [0, 0, 0, 1, 1] and s.ids_exact
    api = by["b1_glaive/3"]
    assert api.input_ids == [1, 2, 3, 40, 41, 2] and api.loss_mask == [0, 0, 0, 1, 1, 1]
    assert api.ids_exact is False and api.source == "api"
    reasons = sorted((d["dataset"], d["sample_id"], d["reason"]) for d in mix.dropped)
    assert reasons == [("b1_glaive", "1", "duplicate_key"), ("b1_glaive", "1", "superseded"),
                       ("b1_glaive", "4", "no_ids"), ("b1_glaive", "5", "error"),
                       ("b5_openthoughts", "8", "duplicate_ids")]
    m = mix.manifest
    assert m["samples"] == 4 and m["records_read"] == 9
    assert m["datasets"]["b1_glaive"]["by_source"] == {
        "local": {"samples": 1, "tokens": 5, "ids_exact": 1}, "api": {"samples": 1, "tokens": 6, "ids_exact": 0}}
    assert m["dropped_counts"]["b1_glaive"] == {"superseded": 1, "duplicate_key": 1, "no_ids": 1, "error": 1}
    assert m["audit_applied"] is False and "NO audit filter" in m["audit_note"]
    assert mix.table()["samples"].sum() == 4
    assert int(mix.dropped_table()["records"].sum()) == 5
    # every journal line is in the mix or dropped with exactly one reason
    assert m["samples"] + len(mix.dropped) == m["records_read"]
    assert mix.weights_table().empty  # no weights asked


def test_audit_verdicts_filter_unless_include_failed(run):
    _write(run.run_dir / "audit" / "verdicts.jsonl", [
        {"dataset": "b1_glaive", "sample_id": 1, "failed": [], "truncated": False},
        {"dataset": "b1_glaive", "sample_id": 2, "failed": ["ends_with_end_of_turn"], "truncated": False},
        {"dataset": "b1_glaive", "sample_id": 3, "failed": [], "truncated": False},
        {"dataset": "b5_openthoughts", "sample_id": 7, "failed": [], "truncated": False},
        {"dataset": "b5_openthoughts", "sample_id": 9, "failed": [], "truncated": True},
    ])
    mix = build_mix(run)
    assert _keys(mix) == {"b1_glaive/3", "b5_openthoughts/7", "b5_openthoughts/9"}
    failed = [d for d in mix.dropped if d["reason"] == "audit_failed"]
    assert failed == [{"dataset": "b1_glaive", "sample_id": "2", "reason": "audit_failed",
                       "checks": ["ends_with_end_of_turn"]}]
    assert mix.manifest["audit_applied"] is True

    run.hidden.include_failed = True
    assert "b1_glaive/2" in _keys(build_mix(run))

    run.hidden.include_failed = False
    run.hidden.drop_truncated = True
    dropped = {d["sample_id"]: d["reason"] for d in build_mix(run).dropped}
    assert dropped["9"] == "truncated"


def test_record_without_verdict_is_not_audited_when_audit_ran(run):
    _write(run.run_dir / "audit" / "verdicts.jsonl",
           [{"dataset": "b1_glaive", "sample_id": 2, "failed": [], "truncated": False}])
    mix = build_mix(run)
    assert _keys(mix) == {"b1_glaive/2"}
    assert mix.manifest["dropped_counts"]["b5_openthoughts"]["not_audited"] == 3


def test_caps_and_seeded_shuffle_are_deterministic(run):
    run.hidden.dataset_caps = {"b1_glaive": 1}
    a, b = build_mix(run, write=False), build_mix(run, write=False)
    assert [s.key for s in a.samples] == [s.key for s in b.samples]
    assert sum(s.dataset == "b1_glaive" for s in a.samples) == 1
    assert sum(d["reason"] == "over_cap" for d in a.dropped) == 1
    orders = set()
    for seed in range(6):
        run.hidden.seed = seed
        orders.add(tuple(s.key for s in build_mix(run, write=False).samples))
    assert len(orders) > 1  # the seed changes the shuffle


def test_journal_order_does_not_change_the_mix(run):
    path = run.run_dir / "records" / "b1_glaive.jsonl"
    before = [s.key for s in build_mix(run, write=False).samples]
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([lines[1], lines[0], *lines[2:]]))  # completion order differs
    assert [s.key for s in build_mix(run, write=False).samples] == before


def test_written_mix_reads_back(run):
    mix = build_mix(run)
    back = read_mix(mix.path.parent)
    assert [(s.key, s.input_ids, s.loss_mask, s.ids_exact) for s in back.samples] == \
        [(s.key, s.input_ids, s.loss_mask, s.ids_exact) for s in mix.samples]
    assert back.manifest["fingerprint"] == mix.manifest["fingerprint"]


def test_bad_reconstruct_line_names_file_line_and_field(run):
    _write(run.run_dir / "reconstruct" / "b1_glaive.jsonl", [{"dataset": "b1_glaive", "sample_id": 3}])
    with pytest.raises(MixError, match=r"reconstruct/b1_glaive.jsonl:1: missing field\(s\) input_ids"):
        build_mix(run)


def test_unknown_dataset_in_hidden_datasets(run):
    run.hidden.datasets = ["b1_glaive", "nope"]
    with pytest.raises(MixError, match="nope"):
        build_mix(run)
    run.hidden.datasets = ["b5_openthoughts"]
    assert {s.dataset for s in build_mix(run).samples} == {"b5_openthoughts"}


@pytest.fixture
def weighted(tmp_path):
    """Three datasets with 12, 6 and 3 records of 6, 5 and 5-6 tokens (prompt 3 + output)."""
    p = _params(tmp_path, datasets=[{"name": n, "path": "builtin:b1_glaive"} for n in ("a", "b", "c")])
    rd = p.run_dir
    _write(rd / "records" / "a.jsonl", [_rec("a", i, output=(100 + i, 7, 2)) for i in range(12)])
    _write(rd / "records" / "b.jsonl", [_rec("b", i, output=(200 + i, 2)) for i in range(6)])
    _write(rd / "records" / "c.jsonl", [_rec("c", i, output=(300 + i,) * (1 + i % 2) + (2,)) for i in range(3)])
    return p


def _count(mix, ds) -> int:
    return sum(s.dataset == ds for s in mix.samples)


def test_sample_weights_give_the_largest_mix_with_those_shares(weighted):
    weighted.hidden.weight_unit = "samples"
    weighted.hidden.dataset_weights = {"a": 2, "b": 1, "c": 1}
    mix = build_mix(weighted, write=False)
    # c (3 samples, weight 1) is the scarcest: 3 per unit of weight -> a 6, b 3, c 3
    assert (_count(mix, "a"), _count(mix, "b"), _count(mix, "c")) == (6, 3, 3)
    assert sum(d["reason"] == "over_weight" for d in mix.dropped) == (12 - 6) + (6 - 3)
    w = mix.manifest["weights"]
    assert w["unit"] == "samples" and w["asked"] == {"a": 0.5, "b": 0.25, "c": 0.25} == w["achieved"]
    assert mix.manifest["settings"]["dataset_weights"] == {"a": 2, "b": 1, "c": 1}
    t = mix.weights_table()
    assert t.loc["a", "weight"] == 2 and t.loc["a", "achieved_share"] == 0.5 and t.loc["c", "amount (samples)"] == 3
    again = build_mix(weighted, write=False)
    assert [s.key for s in again.samples] == [s.key for s in mix.samples]  # seeded: same choice


def test_token_weights_hold_within_one_sample(weighted):
    weighted.hidden.dataset_weights = {"a": 1, "b": 1, "c": 1}  # unit: input tokens
    mix = build_mix(weighted, write=False)
    tokens = {ds: sum(len(s.input_ids) for s in mix.samples if s.dataset == ds) for ds in "abc"}
    # c: prompt 3 + outputs 2, 3, 2 = 16 tokens, the scarcest; a (6 per sample) and b (5) are cut to fit 16
    assert tokens["c"] == 16 and _count(mix, "c") == 3
    assert (tokens["a"], tokens["b"]) == (12, 15)  # short of 16 by less than one sample each
    assert mix.manifest["weights"]["amount"] == tokens


def test_weights_interact_with_caps_and_zero_leaves_a_dataset_out(weighted):
    weighted.hidden.weight_unit = "samples"
    weighted.hidden.dataset_caps = {"a": 2}
    weighted.hidden.dataset_weights = {"a": 1, "b": 1, "c": 0}
    mix = build_mix(weighted, write=False)
    assert (_count(mix, "a"), _count(mix, "b"), _count(mix, "c")) == (2, 2, 0)
    reasons = mix.manifest["dropped_counts"]
    assert reasons["a"] == {"over_cap": 10} and reasons["b"] == {"over_weight": 4} and reasons["c"] == {
        "over_weight": 3}


def test_weights_must_name_every_dataset_and_leave_something(weighted):
    weighted.hidden.dataset_weights = {"a": 1, "b": 1}
    with pytest.raises(MixError, match=r"no weight for \['c'\]"):
        build_mix(weighted, write=False)
    weighted.hidden.dataset_caps = {"c": 0}
    weighted.hidden.dataset_weights = {"a": 1, "b": 1, "c": 1}
    with pytest.raises(MixError, match=r"gives \['c'\] a share"):
        build_mix(weighted, write=False)


@pytest.mark.parametrize("weights, message", [({"a": -1}, "finite and >= 0"), ({"a": 0, "b": 0}, "all 0")])
def test_bad_weights_are_params_errors(tmp_path, weights, message):
    from eagle3data.params import ParamsError

    with pytest.raises(ParamsError, match=message):
        _params(tmp_path, **{"hidden.dataset_weights": weights})
