"""Training mix (04's input): audit filter, rebuilt ids for API records, duplicates, caps, seeded shuffle."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3data.hidden.mix import MixError, build_mix, read_mix
from eagle3data.core.params import load_params
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
        {"dataset": "b5_openthoughts", "sample_id": 7, "failed": [], "flagged": ["text.roundtrip"], "truncated": False},
        {"dataset": "b5_openthoughts", "sample_id": 9, "failed": [], "truncated": True},
    ])
    mix = build_mix(run)
    assert _keys(mix) == {"b1_glaive/3", "b5_openthoughts/7", "b5_openthoughts/9"}  # a flag (audit.flag_only) keeps 7
    failed = [d for d in mix.dropped if d["reason"] == "audit_failed"]
    assert failed == [{"key": "b1_glaive/2", "dataset": "b1_glaive", "sample_id": "2", "turn": None, "reason": "audit_failed",
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
    from eagle3data.core.params import ParamsError

    with pytest.raises(ParamsError, match=message):
        _params(tmp_path, **{"hidden.dataset_weights": weights})


# ---------------------------------------------------------------- turn records (generate.turns: all)
# Two Qwen3-like conversations and a plain record. A turn's prompt holds the earlier turns as the
# template renders them: turn 1 repeats turn 0's whole sequence (an answer with no reasoning to drop),
# turn 2's history drops turn 1's reasoning (ids 60 .. 61), so it shares only turn 1's prompt and
# the reasoning-open id with turn 1's sequence.
P0, O0 = [1, 2, 3], [60, 61, 10, 2]  # <think></think> answer <eot>
P1 = P0 + O0 + [4, 5, 60]  # + user turn + generation prompt
O1 = [70, 71, 61, 11, 2]  # reasoning, </think>, answer
P2 = P1 + [61, 11, 2] + [6, 7, 60]  # turn 1 rendered without its reasoning (70, 71)
O2 = [72, 61, 12, 2]


def _turn(ds, sid, t, prompt, output, **kw):
    return _rec(ds, sid, prompt=prompt, output=output, turn=t, messages=[{"role": "user", "content": f"é {t} ✓"}],
                **kw)


_TURN_DATASETS = [{"name": "b6_ultrachat", "path": "builtin:b6_ultrachat", "turns": "all"},
                  {"name": "b7_sharegpt", "path": "builtin:b7_sharegpt", "turns": "all"}]


def _turn_params(root: Path, **over):
    return _params(root, datasets=_TURN_DATASETS, **over)


@pytest.fixture
def turns_run(tmp_path):
    p = _turn_params(tmp_path)
    rd = p.run_dir
    _write(rd / "records" / "b6_ultrachat.jsonl", [
        _turn("b6_ultrachat", 11, 0, P0, O0),
        _turn("b6_ultrachat", 12, 0, [8] + P0[1:], O0),
        _turn("b6_ultrachat", 11, 1, P1, O1),
        _turn("b6_ultrachat", 12, 1, [8] + P1[1:], O1, conversation_end="done"),  # fails the audit below
        _turn("b6_ultrachat", 11, 2, P2, None, finish_reason="error", error="boom"),  # retried below
        _turn("b6_ultrachat", 11, 2, P2, O2, conversation_end="done"),
        _rec("b6_ultrachat", 13, prompt=(9, 9), output=(14, 2)),  # a record without turns (turns: last)
    ])
    _write(rd / "records" / "b7_sharegpt.jsonl", [
        _turn("b7_sharegpt", "x/1", 0, [5] + P0, O0),
        _turn("b7_sharegpt", "x/1", 1, [5] + P1, O1),
        _turn("b7_sharegpt", "x/1", 2, [5] + P2, None, finish_reason="error", error="server gone",
              conversation_end="error: turn 2: server gone"),  # the conversation's final turn never came
    ])
    return p


def _turn_keys(mix) -> list[str]:
    return sorted(str(s.key) for s in mix.samples)


def test_each_turn_is_its_own_sequence_and_the_manifest_says_what_turns_cost(turns_run):
    mix = build_mix(turns_run)
    assert _turn_keys(mix) == ["b6_ultrachat/11#0", "b6_ultrachat/11#1", "b6_ultrachat/11#2", "b6_ultrachat/12#0",
                               "b6_ultrachat/12#1", "b6_ultrachat/13", "b7_sharegpt/x/1#0", "b7_sharegpt/x/1#1"]
    by = {s.key: s for s in mix.samples}
    assert by["b6_ultrachat/11#2"].input_ids == P2 + O2
    assert by["b6_ultrachat/11#2"].loss_mask == [0] * len(P2) + [1] * len(O2)
    # turn 1 repeats turn 0's whole sequence (7 tokens); turn 2 shares turn 1's prompt + nothing of its reasoning
    # (P1 is a prefix of P2, then 61 vs O1's 70): len(P1) = 10 tokens stored again
    assert len(P0 + O0) == 7 and len(P1) == 10
    t = mix.manifest["turns"]
    turn_tokens = sum(len(by[k].input_ids) for k in by if "#" in k)
    assert t == {"turn_samples": 7, "conversations": 3, "tokens": turn_tokens,
                 "repeated_prefix_tokens": (7 + 10) + 7 + 8,  # conversation 11, 12, x/1 (its prompts start with 5)
                 "last_turn_samples": 3,
                 "last_turn_tokens": len(P2 + O2) + len(P1 + O1) + len(P1 + O1) + 1}
    assert mix.manifest["settings"]["train_turns"] == "all"
    assert {d["reason"] for d in mix.dropped} == {"superseded", "error"}


def test_train_turns_last_keeps_each_conversations_last_usable_turn(turns_run):
    _write(turns_run.run_dir / "audit" / "verdicts.jsonl", [
        {"dataset": d, "sample_id": s, "turn": t, "failed": ["ends_with_end_of_turn"] if (s, t) == (12, 1) else [],
         "truncated": False}
        for d, s, t in [("b6_ultrachat", 11, 0), ("b6_ultrachat", 11, 1), ("b6_ultrachat", 11, 2),
                        ("b6_ultrachat", 12, 0), ("b6_ultrachat", 12, 1), ("b7_sharegpt", "x/1", 0),
                        ("b7_sharegpt", "x/1", 1), ("b7_sharegpt", "x/1", 2)]
    ] + [{"dataset": "b6_ultrachat", "sample_id": 13, "failed": [], "truncated": False}])
    p = _turn_params(turns_run.output_root, **{"hidden.train_turns": "last"})
    mix = build_mix(p)
    # 11: its final turn 2 (the retried error superseded); 12: turn 1 failed the audit, so turn 0;
    # x/1: turn 2 is an error, so turn 1; 13 has no turns and stays
    assert _turn_keys(mix) == ["b6_ultrachat/11#2", "b6_ultrachat/12#0", "b6_ultrachat/13", "b7_sharegpt/x/1#1"]
    reasons = sorted((d["key"].partition("/")[2], d["reason"], d.get("last_turn")) for d in mix.dropped)
    assert all(d["key"] == f'{d["dataset"]}/{d["sample_id"]}#{d["turn"]}' for d in mix.dropped)  # the row, turn apart
    assert reasons == [("11#0", "earlier_turn", 2), ("11#1", "earlier_turn", 2), ("11#2", "superseded", None),
                       ("12#1", "audit_failed", None), ("x/1#0", "earlier_turn", 1), ("x/1#2", "error", None)]
    m = mix.manifest
    assert m["samples"] + len(mix.dropped) == m["records_read"] == 10  # one reason per dropped line
    assert m["dropped_counts"]["b6_ultrachat"] == {"earlier_turn": 2, "superseded": 1, "audit_failed": 1}
    assert m["drop_reasons"]["earlier_turn"].endswith("(hidden.train_turns: last)")
    assert m["settings"]["train_turns"] == "last"
    # one sequence per conversation: nothing of a stored sequence is stored again
    assert m["turns"]["repeated_prefix_tokens"] == 0 and m["turns"]["turn_samples"] == m["turns"]["conversations"] == 3
    # the same records and params give the same mix
    assert [s.key for s in build_mix(p, write=False).samples] == [s.key for s in mix.samples]


def test_export_follows_the_last_turn_mix(turns_run):
    from eagle3data.export.run import select_samples

    p = _turn_params(turns_run.output_root, **{"hidden.train_turns": "last"})
    built = select_samples(p)  # no hidden/mix.parquet: built with the mix rule
    mix = build_mix(p)  # written: 05 reads 04's mix
    read = select_samples(p)
    assert [s.key for s in read.samples] == [s.key for s in mix.samples] == [s.key for s in built.samples]
    assert sorted((d["key"].partition("/")[2], d["reason"]) for d in read.skipped if d["reason"] == "earlier_turn") == [
        ("11#0", "earlier_turn"), ("11#1", "earlier_turn"), ("12#0", "earlier_turn"), ("x/1#0", "earlier_turn")]
    assert all(s.record["turn"] == 2 for s in read.samples if s.key.startswith("b6_ultrachat/11#"))


def test_train_turns_is_checked():
    with pytest.raises(Exception, match="train_turns"):
        load_params(REPO / "params" / "ci.yaml", {"hidden.train_turns": "first"})
