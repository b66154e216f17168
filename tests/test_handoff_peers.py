"""05 hand-off read by the trainers' own released code: SpecForge 0.2.0 and speculators 0.9.0.

Both peers are installed by the Makefile (`--no-deps`, plus the few packages their data
modules import); nothing is installed here. Their data modules import without CUDA: no
stub is needed. The run is the ci run (SmolLM2 embedded, 4 samples), extracted by 04 twice:
once in SpecForge's layout and once in speculators' (both final states stored); each
trainer's hand-off from its own layout hardlinks 04's files, from the other converts.

Final-state check, by the trainer's own head: the embedded run is greedy, so every output
token is the model's argmax at the position before. SpecForge feeds `hidden_state` to a
bare `lm_head`; speculators applies the verifier's final norm, then `lm_head`, to
`verifier_last_hidden_states`. Each must predict the next output token as the model did
(bf16 storage can flip a near-tie: at least 97% here, the model itself being 100%), and
applying the norm a second time (the old export's mistake) must do clearly worse.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest
import torch

# installed by `make install` (Makefile); a missing peer is a failure, not a skip
import specforge.data.preprocessing as specforge_pre

from eagle3data import handoff as HO
from eagle3data.hidden import HiddenReader, read_mix, run_extract
from eagle3data.params import load_params

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(ci_run):
    from eagle3data.models import model_for

    return model_for(ci_run)


@pytest.fixture(scope="module")
def stores(ci_run, model, tmp_path_factory):
    """04 in each trainer's layout on a copy of the ci run, then both hand-offs from each store."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RANK", raising=False)
        mp.delenv("WORLD_SIZE", raising=False)
        for layout in ("specforge", "speculators"):
            root = tmp_path_factory.mktemp(layout)
            shutil.copytree(ci_run.run_dir / "records", root / "ci" / "records")
            p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(root), "hidden.probe_batches": 0,
                                                           "hidden.layout": layout, "export.draft_vocab_size": 64})
            res = run_extract(p, progress=False, model=model)
            assert res.merged and res.validation.ok, res.validation.table()
            mix = read_mix(res.hidden_dir)
            exp = {fmt: HO.write_handoff(p, mix.samples, p.run_dir / "export" / fmt, fmt) for fmt in HO.FORMATS}
            out[layout] = (p, res, mix, exp)
    return out


def _next_token_hits(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """Positions t whose next token t+1 is an output token: how often argmax(logits[t]) == ids[t+1]."""
    pick = mask[1:].bool()
    pred = logits[:-1].argmax(-1)
    return int((pred[pick] == ids[1:][pick]).sum()), int(pick.sum())


def test_specforge_reads_our_features_with_its_own_loader(stores, model):
    from specforge.config.schema import load_config
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    p, res, mix, exp = stores["specforge"]
    out = p.run_dir / "export" / "specforge"
    rd = HiddenReader(res.hidden_dir)
    at = {x: i for i, x in enumerate(rd.states)}
    ds = specforge_pre.build_offline_eagle3_dataset(str(out / "features"), max_len=4096)
    refs = OfflineManifestReader(str(out / "features"), validate_files=True).read()
    assert len(ds) == len(refs) == len(mix.samples) == 4
    hits = total = twice = 0
    for i, s in enumerate(mix.samples):
        n, h = len(s.input_ids), rd.info["hidden_size"]
        item = ds[i]
        assert set(item) == {"attention_mask", "loss_mask", "target", "hidden_state", "input_ids"}
        assert item["target"].shape == (1, n, h) and item["hidden_state"].shape == (1, n, 3 * h)
        assert item["target"].dtype == item["hidden_state"].dtype == torch.bfloat16
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"][0].tolist() == s.input_ids
        # the loader zeroes the mask's last position itself; the rest is ours, aligned to input_ids
        assert item["loss_mask"][0].tolist() == s.loss_mask[:-1] + [0]
        ours = rd.sample(f"{s.dataset}/{s.sample_id}")["hidden_states"]
        assert torch.equal(item["target"][0], ours[:, at["post_norm"]])
        assert torch.equal(item["hidden_state"][0], ours[:, :3].reshape(n, 3 * h))
        # the manifest reader refers to the same file, in the same order, with the keys it wants
        assert refs[i].metadata["file_index"] == i and refs[i].num_tokens == n
        assert set(load_feature_file(refs[i].feature_store_uri.removeprefix("file://"))) >= set(refs[i].feature_keys)
        with torch.inference_mode():
            logits = model.lm_head(item["target"][0].float())
            again = model.lm_head(model.model.norm(item["target"][0].float()))
        mask = torch.tensor(s.loss_mask)
        a, b = _next_token_hits(logits, item["input_ids"][0], mask)
        hits, total = hits + a, total + b
        twice += _next_token_hits(again, item["input_ids"][0], mask)[0]
    assert total > 50 and hits / total >= 0.97, (hits, total)
    assert twice < hits, (twice, hits)
    cfg = load_config(str(out / "specforge.yaml"))
    assert cfg.mode == "offline" and Path(cfg.data.hidden_states_path) == (out / "features").resolve()
    vm = torch.load(cfg.model.vocab_mapping_path, weights_only=True)
    assert vm["d2t"].dtype == torch.int64 and vm["t2d"].dtype == torch.bool and len(vm["d2t"]) == 64
    assert int(vm["t2d"].sum()) == 64 and torch.equal(torch.arange(64) + vm["d2t"], vm["t2d"].nonzero()[:, 0])


def test_speculators_reads_our_dataset_with_its_own_loader(stores, model):
    from speculators.train.cli import parse_vocab_mappings
    from speculators.train.data import ArrowDataset

    p, res, mix, exp = stores["speculators"]
    out = p.run_dir / "export" / "speculators"
    rd = HiddenReader(res.hidden_dir)
    at = {x: i for i, x in enumerate(rd.states)}
    ds = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    assert len(ds) == len(mix.samples) == 4
    assert ds.approx_lengths == [len(s.input_ids) for s in mix.samples]
    hits = total = twice = 0
    for i, s in enumerate(mix.samples):
        n, h = len(s.input_ids), rd.info["hidden_size"]
        item = ds[i]
        assert {"hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask"} <= set(item)
        assert item["hidden_states"].shape == (n, 3 * h) and item["verifier_last_hidden_states"].shape == (n, h)
        assert item["hidden_states"].dtype == torch.bfloat16 and item["input_ids"].tolist() == s.input_ids
        assert item["loss_mask"].tolist() == s.loss_mask  # aligned to input_ids, as in its own datasets
        ours = rd.sample(f"{s.dataset}/{s.sample_id}")["hidden_states"]
        assert torch.equal(item["verifier_last_hidden_states"], ours[:, at["pre_norm"]])
        assert torch.equal(item["hidden_states"], ours[:, :3].reshape(n, 3 * h))
        with torch.inference_mode():
            pre = item["verifier_last_hidden_states"].float()
            logits = model.lm_head(model.model.norm(pre))
            again = model.lm_head(model.model.norm(model.model.norm(pre)))
        mask = torch.tensor(s.loss_mask)
        a, b = _next_token_hits(logits, item["input_ids"], mask)
        hits, total = hits + a, total + b
        twice += _next_token_hits(again, item["input_ids"], mask)[0]
    assert total > 50 and hits / total >= 0.97, (hits, total)
    assert twice < hits, (twice, hits)
    # its CLI finds d2t-<N>.npy / t2d-<N>.npy in the data folder for --draft-vocab-size N
    args = argparse.Namespace(d2t_path=None, t2d_path=None, data_path=str(out), draft_vocab_size=64,
                              token_freq_path=None)
    d2t, t2d, size = parse_vocab_mappings(args)
    assert size == 64 and d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert torch.equal(torch.arange(64) + d2t, t2d.nonzero()[:, 0])


def test_the_matching_layout_is_hardlinked_not_copied(stores):
    for layout, (p, res, mix, exp) in stores.items():
        rd = HiddenReader(res.hidden_dir)
        m = exp[layout]
        assert m["plan"]["mode"] == "link" and m["linked_files"] == 4 and m["converted_bytes"] == 0
        sub = "features" if layout == "specforge" else "hidden_states"
        files = sorted((p.run_dir / "export" / layout / sub).iterdir())
        assert [f.name for f in files] == ([f"{i:09d}.ckpt" for i in range(4)] if layout == "specforge"
                                           else [f"hs_{i}.safetensors" for i in range(4)])
        for i, f in enumerate(files):
            assert os.path.samefile(f, rd.path(i))  # the same inode: no second copy
        other = "speculators" if layout == "specforge" else "specforge"
        assert exp[other]["plan"]["mode"] == "convert" and exp[other]["converted_files"] == 4
        disk = HO.disk_table(res.hidden_dir, {f: p.run_dir / "export" / f for f in HO.FORMATS}).set_index("folder")
        linked = disk.filter(like=f"{layout}:", axis=0)["new_vs_hidden"].item()
        converted = disk.filter(like=f"{other}:", axis=0)["new_vs_hidden"].item()
        assert linked < 0.05 < 0.5 < converted, disk  # the copy holds 4 of the store's 5 states


def test_the_estimate_states_each_hand_off_before_04_runs(ci_run, tmp_path):
    from eagle3data import hidden as H

    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    for layout, link in (("shards", None), ("specforge", "specforge"), ("speculators", "speculators")):
        p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "hidden.layout": layout})
        est = H.estimate(p)
        extra = est.handoff()
        assert est.bytes_per_token == 5 * 576 * 2 + H.ID_MASK_BYTES[layout]
        for fmt in HO.FORMATS:
            want = 0 if fmt == link else est.tokens * H.bytes_per_token(576, "bfloat16", 4, fmt)
            assert extra[fmt] == want, (layout, fmt)
        assert f"05 hand-off to {link or 'specforge'} (extra GB)" in est.table().index
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "hidden.final_state": "pre_norm"})
    assert H.estimate(p).handoff()["specforge"] is None  # post-norm cannot be recovered exactly: says so up front


def test_a_mix_sample_missing_from_the_store_stops_the_hand_off(stores, tmp_path):
    from dataclasses import replace

    p, res, mix, exp = stores["speculators"]
    bad = [mix.samples[0], replace(mix.samples[1], input_ids=[mix.samples[1].input_ids[0] + 7] + mix.samples[1].input_ids[1:])]
    with pytest.raises(HO.HandoffError, match="differ from the mix sample"):
        HO.write_handoff(p, bad, tmp_path / "x", "speculators")
    gone = [replace(mix.samples[0], sample_id="nope")]
    with pytest.raises(HO.HandoffError, match="not in 04's index"):
        HO.write_handoff(p, gone, tmp_path / "y", "speculators")


def test_04_records_its_final_state_and_refuses_a_store_of_another_kind(stores, ci_run, model, tmp_path, monkeypatch):
    from eagle3data.hidden import AUX_NAMES, HiddenError

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    over = {"output_root": str(tmp_path), "hidden.probe_batches": 0}
    p = load_params(REPO / "params" / "ci.yaml", {**over, "hidden.final_state": "pre_norm"})
    res = run_extract(p, progress=False, model=model)
    rd = HiddenReader(res.hidden_dir)
    assert rd.states == AUX_NAMES + ("pre_norm",) and rd.info["final_state"] == "pre_norm"
    both = HiddenReader(stores["speculators"][1].hidden_dir)
    for k in rd.keys():
        a, b = rd.sample(k)["hidden_states"], both.sample(k)["hidden_states"]
        assert a.shape[1] == 4 and b.shape[1] == 5
        # other batch composition: equal to within one bf16 ulp (tests/test_hidden.py explains)
        torch.testing.assert_close(a.float(), b[:, :4].float(), rtol=2**-7, atol=1e-2)
    with pytest.raises(HO.HandoffError, match="needs the post_norm final state"):
        HO.write_handoff(p, read_mix(res.hidden_dir).samples, tmp_path / "sf", "specforge")
    with pytest.raises(HiddenError, match="stored as layout 'shards' with states"):
        run_extract(load_params(REPO / "params" / "ci.yaml", over), progress=False, model=model)
