"""04_extract_hidden: stored states vs a plain forward, bit-exact read-back, resume, two workers, refusals.

Tolerance of the state check: the stored bf16 value of every element is within one bf16 ulp
of the float32 reference (|stored - ref| <= 2**-7 * |ref| + 1e-2), and at least 99.9% of
elements equal the reference rounded to bf16 exactly. The rest differ because a padded
batch sums in another order than a lone sequence (float32 differences ~1e-6 that flip a
bf16 rounding). A sequence extracted alone (no padding) matches bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from eagle3data.hidden import estimate as E
from eagle3data.hidden import extract as H
from eagle3data.hidden.capture import layer_plan, plan_batches
from eagle3data.hidden.extract import run_extract
from eagle3data.hidden.mix import hidden_dir, read_mix, source_sequences
from eagle3data.hidden.store.format import HiddenError, read_shard_meta, shard_dir
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.store.validation import validate_store
from eagle3data.core.params import load_params
from eagle3data.core.quant import StateCodec

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(ci_run):
    from eagle3data.core.models import model_for

    return model_for(ci_run)


@pytest.fixture
def run_copy(ci_run, tmp_path):
    """A private copy of the generated ci run (records only); returns a params factory for it."""
    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")

    def make(**over):
        base = {"output_root": str(tmp_path), "hidden.probe_batches": 0}
        return load_params(REPO / "params" / "ci.yaml", {**base, **over})

    return make


@pytest.fixture(scope="module")
def single(ci_run, model, tmp_path_factory):
    """One worker's finished extraction of the ci run (small shards: several per run), in bf16 (the states as
    captured: the reference the 8-bit stores are compared with). Do not change it."""
    root = tmp_path_factory.mktemp("single")
    shutil.copytree(ci_run.run_dir / "records", root / "ci" / "records")
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(root), "hidden.probe_batches": 0,
                                                   "hidden.shard_bytes": 1_500_000, "hidden.storage": "bf16"})
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RANK", raising=False)
        mp.delenv("WORLD_SIZE", raising=False)
        return p, run_extract(p, progress=False, model=model)


def _reference(model, ids: list[int]) -> torch.Tensor:
    """The five states of one sequence (aux x 3, pre-norm, post-norm) from a plain full forward.

    HF `hidden_states` give the aux layers and the normed final state ([30]); the pre-norm
    output of the last layer is not among them, so a hook on that layer takes it.
    """
    got = {}
    h = model.model.layers[29].register_forward_hook(lambda m, i, o: got.setdefault("pre", o[0] if isinstance(o, tuple) else o))
    try:
        with torch.inference_mode():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        h.remove()
    assert len(hs) == 31  # embeddings + 30 layers: HF index i = output of layer i-1; [30] is normed
    with torch.inference_mode():
        assert torch.equal(model.model.norm(got["pre"]), hs[30])  # post-norm = norm(pre-norm), in float32
    return torch.stack([hs[i][0] for i in (2, 15, 27)] + [got["pre"][0], hs[30][0]], dim=1)


def test_layers_follow_the_profile_rule_on_the_real_model(ci_run, model):
    plan = layer_plan(ci_run, model.config)
    assert plan.num_layers == 30
    assert plan.hf_indices == (2, 15, 27) and plan.layer_outputs == (1, 14, 26)


def test_stored_states_match_a_plain_full_forward(single, model):
    p, res = single
    assert res.merged and res.validation.ok, res.validation.table()
    assert res.stats["pad_fraction"] is not None
    exact = total = 0
    for smp in HiddenReader(res.hidden_dir):
        got = smp["hidden_states"]
        assert got.dtype == torch.bfloat16 and got.shape == (len(smp["input_ids"]), 5, 576)
        ref = _reference(model, smp["input_ids"].tolist())
        g = got.float()
        assert bool(((g - ref).abs() <= 2**-7 * ref.abs() + 1e-2).all()), smp["sample_id"]
        exact += int((got == ref.to(torch.bfloat16)).sum())
        total += got.numel()
    assert exact / total >= 0.999


def test_a_sequence_alone_matches_the_full_forward_bit_for_bit(run_copy, model, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = run_copy(**{"hidden.batch_tokens": 1, "hidden.datasets": ["b5_openthoughts"], "hidden.storage": "bf16"})
    res = run_extract(p, progress=False, model=model)
    assert res.stats["batches"] == 2 and res.stats["pad_fraction"] == 0.0
    for smp in HiddenReader(res.hidden_dir):
        ref = _reference(model, smp["input_ids"].tolist()).to(torch.bfloat16)
        assert torch.equal(smp["hidden_states"], ref)


def test_index_reads_back_every_sample_bit_exactly(single):
    from safetensors.torch import load_file

    p, res = single
    rd = HiddenReader(res.hidden_dir)
    mix = read_mix(res.hidden_dir)
    assert len(rd) == len(mix.samples) == 4
    assert list(rd.index["position"]) == list(range(4))  # index rows follow the mix order
    assert len(set(rd.index["shard"])) > 1
    sources = source_sequences(p)
    streamed = {f"{s['dataset']}/{s['sample_id']}": s for s in rd}
    assert set(streamed) == set(rd.keys())
    shards = {name: load_file(str(res.hidden_dir / name)) for name in set(rd.index["shard"])}
    for key in rd.keys():
        one = rd.sample(key)
        row = rd.index.iloc[rd.keys().index(key)]
        a, n = int(row["offset"]), int(row["length"])
        whole = shards[row["shard"]]
        for name in ("hidden_states", "input_ids", "loss_mask"):
            assert torch.equal(one[name], whole[name][a : a + n])
            assert torch.equal(one[name], streamed[key][name])
        assert one["input_ids"].tolist() == sources[key].input_ids
        assert one["loss_mask"].tolist() == sources[key].loss_mask
        assert int(row["loss_tokens"]) == sum(sources[key].loss_mask)
    # nothing but data on disk: 5 states (final_state both) x hidden x 2 bytes + int32 id + uint8 mask per token
    data = sum(sum(t.numel() * t.element_size() for t in s.values()) for s in shards.values())
    assert data == int(rd.index["length"].sum()) * (5 * 576 * 2 + 4 + 1)
    assert rd.info["states"] == ["aux_low", "aux_mid", "aux_high", "pre_norm", "post_norm"]


# the existing resume and ranks tests, run on each storage (issue 27): the 8-bit paths go through the
# same writer, index and reader, with their scales (and per-shard channel statistics) beside the values
STORAGES = {"bf16": {"hidden.storage": "bf16"}, "int8": {"hidden.storage": "int8"},
            "fp8_e4m3": {"hidden.storage": "fp8_e4m3", "hidden.storage_scale": "token"}}
# worst relative error (per sample, all states) of a storage against the bf16 store of the same samples
STORAGE_REL = {"bf16": 0.0, "int8": 0.02, "fp8_e4m3": 0.06}


def _same_states(ref: HiddenReader, got: HiddenReader, storage: str) -> None:
    """Same keys, ids and masks; states equal to bf16's within the storage's resolution (and one bf16 ulp)."""
    assert set(got.keys()) == set(ref.keys())
    for key in ref.keys():
        a, b = ref.sample(key), got.sample(key)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        x, y = a["hidden_states"].float(), b["hidden_states"].float()
        if storage == "bf16":  # batch composition differs between runs: equal to within one bf16 ulp
            torch.testing.assert_close(x, y, rtol=2**-7, atol=1e-2)
        else:
            rel = float((y - x).norm() / x.norm())
            assert rel < STORAGE_REL[storage], (key, storage, rel)


@pytest.mark.parametrize("storage", list(STORAGES))
def test_resume_after_a_crash_keeps_finished_shards_and_redoes_the_partial_one(single, run_copy, model, monkeypatch,
                                                                               storage):
    _, full = single
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = run_copy(**{"hidden.shard_bytes": 1_500_000, "run_name": "ci", **STORAGES[storage]})
    shutil.rmtree(hidden_dir(p), ignore_errors=True)
    first = run_extract(p, progress=False, model=model, max_new_shards=1)
    assert first.stats["stopped_early"] and not first.merged
    sdir = shard_dir(hidden_dir(p))
    [kept] = sorted(sdir.glob("*.safetensors"))
    kept_bytes, kept_ino = kept.read_bytes(), kept.stat().st_ino
    # the crash hit while writing the next shard: a partial .tmp, and a truncated "finished" one
    (sdir / "r000-00001.safetensors.tmp").write_bytes(kept_bytes[: len(kept_bytes) // 2])
    (sdir / "r000-00002.safetensors").write_bytes(kept_bytes[: len(kept_bytes) // 3])

    res = run_extract(p, progress=False, model=model)
    assert res.merged and res.validation.ok, res.validation.table()
    assert res.stats["partial_shards_discarded"] == 2
    assert res.stats["already_stored"] == len(read_shard_meta(kept)["samples"]) >= 1
    assert kept.stat().st_ino == kept_ino and kept.read_bytes() == kept_bytes
    assert not list(sdir.glob("*.tmp"))
    rd = HiddenReader(hidden_dir(p))
    stored = [f"{e['dataset']}/{e['sample_id']}" for s in sdir.glob("*.safetensors")
              for e in read_shard_meta(s)["samples"]]
    assert len(stored) == len(set(stored)) == 4  # no sample stored twice
    assert StateCodec.of_info(rd.info, 5) == p.hidden.codec()  # the store says the storage it holds
    _same_states(HiddenReader(full.hidden_dir), rd, storage)


@pytest.mark.parametrize("storage", list(STORAGES))
def test_two_workers_store_the_same_samples_as_one(single, run_copy, model, monkeypatch, storage):
    _, full = single
    one = HiddenReader(full.hidden_dir)
    p = run_copy(**{"hidden.out_dir": str(full.hidden_dir.parent / f"hidden_2w_{storage}"),
                    "hidden.shard_bytes": 1_500_000, **STORAGES[storage]})
    results = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        results.append(run_extract(p, progress=False, model=model))
    r0, r1 = results
    assert not r0.merged and r0.waiting_for == 2  # rank 1's half is not there yet
    assert r1.merged and r1.validation.ok
    sdir = shard_dir(hidden_dir(p))
    parts = [{f"{e['dataset']}/{e['sample_id']}" for s in sdir.glob(f"r{r:03d}-*.safetensors")
              for e in read_shard_meta(s)["samples"]} for r in (0, 1)]
    assert parts[0] and parts[1] and not parts[0] & parts[1]  # disjoint, both non-empty
    two = HiddenReader(hidden_dir(p))
    assert set(two.keys()) == parts[0] | parts[1]
    _same_states(one, two, storage)


def test_too_long_sequences_are_reported_and_skipped(run_copy, model, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = run_copy(**{"model.max_context": 120})
    res = run_extract(p, progress=False, model=model)
    mix = read_mix(res.hidden_dir)
    # the one selection rule drops them from the mix (reason too_long), so 04 and 05 agree on the samples
    long = {f"{d['dataset']}/{d['sample_id']}": d["tokens"] for d in mix.dropped if d["reason"] == "too_long"}
    assert long and all(n > 120 for n in long.values()) and all(len(s.input_ids) <= 120 for s in mix.samples)
    assert {f"{d['dataset']}/{d['sample_id']}" for d in res.too_long} == set(long)
    assert set(res.too_long_table()["tokens"]) == set(long.values())
    rd = HiddenReader(res.hidden_dir)
    assert rd.keys() == [str(s.key) for s in mix.samples]
    assert res.validation.ok and res.validation.too_long == len(long)


def test_refuses_to_start_when_the_disk_lacks_room(run_copy, model, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = run_copy()
    monkeypatch.setattr(E, "_free_bytes", lambda path: 1000)
    with pytest.raises(HiddenError, match=r"not enough disk .* hidden.out_dir"):
        run_extract(p, progress=False, model=model)
    assert not list(shard_dir(hidden_dir(p)).glob("*"))


def test_estimate_is_tokens_times_four_states_plus_ids_and_mask(run_copy, model, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = run_copy(**{"hidden.probe_batches": 1, "hidden.storage": "bf16"})
    est = H.estimate(p, model=model)
    tokens = sum(len(s.input_ids) for s in read_mix(hidden_dir(p)).samples)
    assert est.tokens == tokens and est.bytes == tokens * (5 * 576 * 2 + 5)
    # the default storage (int8/channel_rms on shards): its values and scales, plus ids and mask
    q = run_copy(**{"hidden.probe_batches": 1})
    assert q.hidden.storage == "int8" and H.estimate(q, model=model).bytes == tokens * (5 * 576 + 5 * 4 + 5)
    assert est.tokens_per_s and est.seconds and est.fits
    assert "estimated size (GB)" in est.table().index


def test_validation_flags_ids_that_differ_from_the_records(single, tmp_path):
    import orjson

    p0, _ = single
    shutil.copytree(p0.run_dir, tmp_path / "ci")
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path)})
    assert validate_store(p).ok
    path = p.run_dir / "records" / "b5_openthoughts.jsonl"
    recs = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    recs[0]["output_ids"][0] += 1
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    v = validate_store(p)
    assert [(x["sample_id"], x["check"]) for x in v.problems] == [(str(recs[0]["sample_id"]), "ids")]


def test_plan_batches_respects_the_budget_and_groups_similar_lengths():
    lengths = [5, 100, 7, 98, 6, 99, 300]
    batches = plan_batches(lengths, 200)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 200
    assert batches[0] == [6]  # longest first; alone since it exceeds the budget
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert 1 - sum(lengths) / padded < 0.05


def test_rank_and_world_size_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert H.dist_env() == (3, 4)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(HiddenError, match="RANK=4"):
        H.dist_env()


def test_estimate_says_what_per_turn_sequences_cost(tmp_path, monkeypatch):
    """Turn records store the conversation so far again per turn: the estimate counts those tokens and bytes,
    and what `hidden.train_turns: last` would store, which is what a `last` mix then holds."""
    from runfiles import make_record, write_jsonl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    over = {"output_root": str(tmp_path), "hidden.probe_batches": 0,
            "datasets": [{"name": "b6_ultrachat", "path": "builtin:b6_ultrachat", "turns": "all"}]}
    p0, o0 = [1, 2, 3], [60, 61, 10, 2]
    p1, o1 = p0 + o0 + [4, 5, 60], [70, 71, 61, 11, 2]
    p2, o2 = p1 + [61, 11, 2, 6, 7, 60], [72, 61, 12, 2]  # turn 1's reasoning (70, 71) dropped from the history
    recs = [make_record("b6_ultrachat", "c1", p, o, turn=t, messages=[{"role": "user", "content": f"ça {t}"}])
            for t, (p, o) in enumerate([(p0, o0), (p1, o1), (p2, o2)])]
    recs += [make_record("b6_ultrachat", "c2", [9] + p0, o0, turn=0),
             make_record("b6_ultrachat", "solo", (8, 8, 8), (13, 2))]
    write_jsonl(tmp_path / "ci" / "records" / "b6_ultrachat.jsonl", recs)
    est = H.estimate(load_params(REPO / "params" / "ci.yaml", over))
    tc = est.turn_cost()
    repeated = len(p0 + o0) + len(p1)  # turn 1 repeats turn 0's sequence; turn 2 turn 1's prompt
    turn_tokens = len(p0 + o0) + len(p1 + o1) + len(p2 + o2) + len([9] + p0 + o0)
    assert tc["turn_samples"] == 4 and tc["conversations"] == 2 and tc["tokens"] == turn_tokens
    assert tc["repeated_prefix_tokens"] == repeated and tc["repeated_prefix_bytes"] == repeated * est.bytes_per_token
    assert tc["last_turn_tokens"] == len(p2 + o2) + len([9] + p0 + o0) and tc["last_turn_samples"] == 2
    rows = est.table()["value"]
    assert rows["turn prefixes stored again: tokens (GB, share)"].startswith(f"{repeated:,} (")
    assert rows["with hidden.train_turns: last: sequences, tokens (GB)"].startswith(f"2, {tc['last_turn_tokens']:,} (")
    assert est.as_dict()["turns"]["repeated_prefix_tokens"] == repeated
    # what the estimate says `last` would store is what the `last` mix stores (no caps here)
    last = H.estimate(load_params(REPO / "params" / "ci.yaml", {**over, "hidden.train_turns": "last"}))
    assert last.tokens == tc["last_turn_tokens"] + 5 and last.samples == 3
    assert last.turn_cost()["repeated_prefix_tokens"] == 0
    assert est.tokens == turn_tokens + 5
    # a run without turn records: no turn figures, no turn rows
    write_jsonl(tmp_path / "plain" / "ci" / "records" / "b6_ultrachat.jsonl", recs[-1:])
    plain = H.estimate(load_params(REPO / "params" / "ci.yaml", {**over, "output_root": str(tmp_path / "plain")}))
    assert plain.turn_cost() is None and plain.as_dict()["turns"] is None
    assert not any(str(k).startswith(("turn", "with hidden.train_turns")) for k in plain.table().index)
