"""verify-hidden: a store whose states are not the target's own is caught, sample by sample.

The store is 04's own extraction of the committed nbval fixture run (SmolLM2, 7 local greedy
records) plus one record cut to the length of another (so two samples of the same length can be
swapped). Each mutation changes a copy of the store on disk the way an engine bug would; the
verification must flag that sample (both samples of a swap) and no other, by a cheap check and by
the recompute; the clean store, and a store in each trainer's layout, must pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orjson
import pytest
import torch

from eagle3data.cli import main as cli_main
from eagle3data.core.params import load_params
from eagle3data.core.params.hidden import default_storage
from eagle3data.export.run import ExportError, export_format
from eagle3data.hidden.capture import load_config
from eagle3data.hidden.extract import run_extract
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.verify.head import load_head
from eagle3data.hidden.verify.command import BACKENDS, parse_recompute
from eagle3data.hidden.verify.run import DEFAULT_POSITIONS, verify_store
from eagle3data.core.models import resolve_model_path
from runfiles import as_written

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "runs" / "nbval"
TWIN = ("b4_mixturethoughts", 4001, 4003)  # 4001 cut to 4003's length (same length, other prompt)


def _make_run(root: Path, **over) -> object:
    """The nbval fixture records plus the same-length twin, with 04's params (no auto-verify), stored in bf16 unless
    `over` names a storage: the mutations below write into the stored values, which only bf16 holds as they are
    (an 8-bit store's scales and channel statistics would turn a planted swap into another change)."""
    rec = root / "nbval" / "records"
    shutil.copytree(FIXTURE / "records", rec)
    path = rec / f"{TWIN[0]}.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    by_id = {r["sample_id"]: r for r in lines}
    a, b = by_id[TWIN[1]], by_id[TWIN[2]]
    cut = len(b["prompt_ids"]) + len(b["output_ids"]) - len(a["prompt_ids"])
    twin = {**a, "sample_id": 4009, "output_ids": a["output_ids"][:cut], "finish_reason": "length"}
    path.write_text(path.read_text() + json.dumps(twin) + "\n")
    base = {"output_root": str(root), "hidden.probe_batches": 0, "hidden.verify_after": False,
            "hidden.storage": "bf16"}
    return load_params(REPO / "tests" / "fixtures" / "nbval.yaml", {**base, **over})


_MODEL = {}


def _model(p):
    from eagle3data.core.models import model_for

    return _MODEL.setdefault("m", model_for(p))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """04's clean store of the fixture run (shards, both final states), not verified yet. Do not change it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RANK", raising=False)
        mp.delenv("WORLD_SIZE", raising=False)
        p = _make_run(tmp_path_factory.mktemp("verify"))
        res = run_extract(p, progress=False, model=_model(p))
    assert res.merged and res.validation.ok
    return p


def _copy(p, tmp_path, **over):
    """A private copy of the run (records, provenance, store) for one mutation; `over`: its hidden params (bf16)."""
    dst = tmp_path / "run"
    shutil.copytree(p.run_dir, dst / p.run_name)
    return load_params(REPO / "tests" / "fixtures" / "nbval.yaml",
                       {"output_root": str(dst), "hidden.probe_batches": 0, "hidden.verify_after": False,
                        "hidden.storage": "bf16", **over})


class _Memo:
    """The HF recompute backend (04's Capture), each distinct sequence forwarded once for the module, per kind of
    capture (the states it keeps and their dtype: stores of other final states or dtypes get their own)."""

    seen: dict[tuple, torch.Tensor] = {}

    def __init__(self, capture):
        self.capture = capture

    def run(self, input_ids):
        k = (self.capture.names, str(self.capture.dtype), tuple(input_ids[0].tolist()))
        if k not in self.seen:
            self.seen[k] = self.capture.run(input_ids)
        return self.seen[k]

    def close(self):
        self.capture.close()


def _verify(p, recompute=0, positions=DEFAULT_POSITIONS):
    """verify-hidden on a run with the HF recompute backend (one model for the whole module)."""
    cfg = load_config(p)
    info = HiddenReader(hidden_dir(p)).info
    make = BACKENDS["hf"](p, info, cfg, model=_model(p))
    return verify_store(p, config=cfg, backend=lambda: _Memo(make()), recompute=recompute, positions=positions)


def _failed(res) -> dict[str, list[str]]:
    return {r["key"]: r["failed"] for r in res.rows if r["failed"]}


def _store_states(p):
    """The store's files by shard, its states end to end `hs`, its loss masks, each key's (start, length) in `hs`
    and each shard's first row in it (bf16 stores: the values as stored)."""
    from safetensors.torch import load_file

    rd = HiddenReader(hidden_dir(p))
    shards = sorted(set(rd.index["shard"]))
    files = {s: load_file(str(hidden_dir(p) / s)) for s in shards}
    base, start = {}, 0
    for s in shards:
        base[s] = start
        start += files[s]["hidden_states"].shape[0]
    hs = torch.cat([files[s]["hidden_states"] for s in shards])
    mask = torch.cat([files[s]["loss_mask"] for s in shards])
    rows = {k: (base[rd.index.iloc[i]["shard"]] + int(rd.index.iloc[i]["offset"]), int(rd.index.iloc[i]["length"]))
            for i, k in enumerate(rd.keys())}
    return files, hs, mask, rows, base


def _mutate(p, change) -> None:
    """Apply `change(hs, rows, mask)` to the store's states on disk: `hs` is every shard's states end to end,
    `rows` each key's (start, length) in it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files, hs, mask, rows, base = _store_states(p)
    change(hs, rows, mask)
    for s in files:
        with safe_open(str(hidden_dir(p) / s), framework="pt") as f:
            meta = f.metadata()
        n = files[s]["hidden_states"].shape[0]
        files[s]["hidden_states"] = hs[base[s]:base[s] + n].clone()
        save_file(files[s], str(hidden_dir(p) / s), metadata=meta)
    as_written(hidden_dir(p), *files)  # the fault as an engine writes it: its checksum is the file's


def _mutate_before_storing(p, src, change) -> None:
    """The fault as an engine makes it in an 8-bit store: `change` applied to the states as captured (the clean bf16
    store `src` of the same run, every state), then `p`'s files written from them as 04 writes them: each shard
    encoded by its codec at the shard's flush (the faulty block's own scales and channel statistics), each per-sample
    file by its trainer's `write_sample` (speculators' FP8 file: one scale per token)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from eagle3data.hidden.store.format import split_states
    from eagle3data.trainers.registry import get_trainer

    _, hs, mask, rows, _ = _store_states(src)
    change(hs, rows, mask)
    rd = HiddenReader(hidden_dir(p))
    assert rd.codec.quantized
    have = list(HiddenReader(hidden_dir(src)).info["states"])
    names = tuple(rd.info["states"])
    hs = hs[:, [have.index(x) for x in names]]
    if rd.layout != "shards":
        trainer = get_trainer(rd.layout)
        for i, k in enumerate(rd.keys()):
            path = hidden_dir(p) / rd.index.iloc[i]["shard"]
            ids, lm = trainer.read_ids(path)
            aux, finals = split_states(hs[rows[k][0]:rows[k][0] + rows[k][1]], names)
            trainer.write_sample(path, ids, lm, aux, finals, trainer.read_meta(path), storage=rd.codec.aux)
            as_written(hidden_dir(p), path)
        return
    for shard in sorted(set(rd.index["shard"])):
        part = sorted((int(rd.index.iloc[i]["offset"]), k) for i, k in enumerate(rd.keys())
                      if rd.index.iloc[i]["shard"] == shard)
        block = torch.cat([hs[rows[k][0]:rows[k][0] + rows[k][1]] for _, k in part])
        path = hidden_dir(p) / shard
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        t = load_file(str(path))
        assert [o for o, _ in part] == [sum(rows[k][1] for _, k in part[:i]) for i in range(len(part))]
        assert block.shape[0] == t["input_ids"].shape[0]
        t.update(rd.codec.encode(block))
        save_file(t, str(path), metadata=meta)
        as_written(hidden_dir(p), path)


def _prompt_len(mask, a, n):
    return int((mask[a:a + n] == 0).sum())


TARGET = "b1_glaive/1602"
SAME_A, SAME_B = f"{TWIN[0]}/{TWIN[2]}", f"{TWIN[0]}/4009"


def m_zero(hs, rows, mask):
    a, n = rows[TARGET]
    hs[a + 5:a + 9] = 0


def m_nan(hs, rows, mask):
    a, n = rows[TARGET]
    hs[a + 3, 1, 7] = float("nan")


def m_shift(hs, rows, mask):
    a, n = rows[TARGET]
    hs[a:a + n] = torch.roll(hs[a:a + n].clone(), -1, dims=0)


def m_swap_samples(hs, rows, mask):
    (a, n), (b, m) = rows[SAME_A], rows[SAME_B]
    assert n == m
    x = hs[a:a + n].clone()
    hs[a:a + n] = hs[b:b + m]
    hs[b:b + m] = x


def m_swap_aux(hs, rows, mask):
    a, n = rows[TARGET]
    hs[a:a + n, [0, 1]] = hs[a:a + n, [1, 0]].clone()


def m_aux_twice(hs, rows, mask):
    a, n = rows[TARGET]
    hs[a:a + n, 2] = hs[a:a + n, 1]


def m_post_as_pre(hs, rows, mask):
    a, n = rows[TARGET]
    hs[a:a + n, 3] = _HEAD.norm(hs[a:a + n, 3]).to(hs.dtype)  # the store says pre-norm, holds post-norm


def m_pre_as_post(hs, rows, mask):
    a, n = rows[TARGET]
    hs[a:a + n, 4] = (hs[a:a + n, 3].float() * 1.001).to(hs.dtype)  # says post-norm, holds (about) the pre-norm


def m_prompt_from_other(hs, rows, mask):
    """The whole prompt part from another request of the same dataset (longer, so it covers the prompt; they share
    the 57-token system prompt, whose states are the same in both)."""
    a, n = rows[TARGET]
    c, m = rows["b1_glaive/1603"]
    k = _prompt_len(mask, a, n)
    assert m >= k
    hs[a:a + k] = hs[c:c + k].clone()


SHARED = f"{TWIN[0]}/{TWIN[1]}"  # its whole prompt (and the start of its output) is the twin's too


def m_prompt_inside_shared_prefix(hs, rows, mask):
    """The first 80% of the prompt rows of a sample whose prompt another sample shares (the twin), from a sample
    that shares only the chat template's first tokens: the prompt z draws after the shared prefix, so only the
    comparison with the twin's rows sees it (issue 43: 369 of 505 shared prompt rows in a hidden check)."""
    a, n = rows[SHARED]
    c, m = rows[SAME_A]
    k = _prompt_len(mask, a, n) * 4 // 5
    assert m >= k
    hs[a:a + k] = hs[c:c + k].clone()


_HEAD = None
MUTATIONS = {
    "zeroed_rows": (m_zero, {TARGET}, "flat_rows"),
    "nan": (m_nan, {TARGET}, "finite"),
    "shifted_one_position": (m_shift, {TARGET}, "head_logit_z"),
    "same_length_samples_swapped": (m_swap_samples, {SAME_A, SAME_B}, "head_logit_z"),
    "aux_layers_swapped": (m_swap_aux, {TARGET}, "norm_profile"),
    "aux_layer_stored_twice": (m_aux_twice, {TARGET}, "layer_duplicate"),
    "post_norm_said_pre_norm": (m_post_as_pre, {TARGET}, "final_kind"),
    "pre_norm_said_post_norm": (m_pre_as_post, {TARGET}, "final_kind"),
    "prompt_from_another_sample": (m_prompt_from_other, {TARGET}, "prompt_logit_z"),
    "prompt_inside_a_shared_prefix": (m_prompt_inside_shared_prefix, {SHARED}, "shared_prefix"),
}


def test_the_clean_store_passes_every_check_with_recompute_all(clean, tmp_path):
    p = _copy(clean, tmp_path)
    res = _verify(p, recompute="all")
    assert _failed(res) == {} and res.ok, _failed(res)
    s = res.summary
    assert s["samples"] == 8 and s["recomputed"] == 8 and s["norm_profile"] == "judged"
    assert s["checks"]["recompute"]["applicable"] == 8 and s["checks"]["run_head_top1"]["applicable"] == 1
    # the cut twin and its source share their whole prompt: no prompt position tells them apart
    assert s["checks"]["head_logit_z"]["applicable"] == 8 and s["checks"]["prompt_logit_z"]["applicable"] == 6
    assert s["checks"]["finite"]["upper95"] == pytest.approx(3 / 8)  # rule of three, as 03 states it
    lines = [orjson.loads(x) for x in (hidden_dir(p) / "verify.jsonl").read_bytes().splitlines()]
    assert [x["key"] for x in lines] == HiddenReader(hidden_dir(p)).keys() and all(x["failed"] == [] for x in lines)
    assert s["head"]["exact_positions"] >= 8 and s["head"]["pooled_greedy_top1"] >= 0.85
    assert all(x["out_z_mean"] >= 4.5 for x in lines)
    info = orjson.loads((hidden_dir(p) / "index.json").read_bytes())
    assert info["verification"]["ok"] is True and info["verification"]["samples"] == 8


def test_a_backend_with_prepare_gets_every_picked_samples_stored_ids_before_the_pass(clean, tmp_path):
    """A recompute backend that computes all its samples at once (SGLang's two passes, verify/sglang.py) has
    `prepare`: verify_store hands it the stored ids of exactly the picked samples, in store order, before its first
    `run`, and each `run` asks for one of them; `hf` and `vllm` backends have none and are called as before."""
    from eagle3data.hidden.verify.run import recompute_picks

    calls = []

    class Prepared(_Memo):
        def prepare(self, samples):
            calls.append(("prepare", [list(x) for x in samples]))

        def run(self, input_ids):
            calls.append(("run", input_ids[0].tolist()))
            return super().run(input_ids)

        def close(self):
            calls.append(("close", None))
            super().close()

    p = _copy(clean, tmp_path)
    cfg, rd = load_config(p), HiddenReader(hidden_dir(p))
    make = BACKENDS["hf"](p, rd.info, cfg, model=_model(p))
    res = verify_store(p, config=cfg, backend=lambda: Prepared(make()), recompute=1)
    picks = recompute_picks(rd, 1)
    want = [rd.stored_ids(i)[0] for i, k in enumerate(rd.keys()) if k in picks]
    assert len(want) == len(picks) >= 1 and calls[0] == ("prepare", want) and calls[-1] == ("close", None)
    runs = [ids for what, ids in calls[1:-1]]
    assert [what for what, _ in calls[1:-1]] == ["run"] * len(want) and sorted(runs) == sorted(want)
    assert res.ok and res.summary["recomputed"] == len(picks)


@pytest.mark.parametrize("kind", list(MUTATIONS))
def test_each_mutation_flags_its_sample_and_no_other(clean, tmp_path, kind):
    global _HEAD
    if _HEAD is None:
        _HEAD = load_head(resolve_model_path(clean.model.path), load_config(clean))
    change, keys, check = MUTATIONS[kind]
    p = _copy(clean, tmp_path)
    _mutate(p, change)
    res = _verify(p, recompute="all")  # the default head positions (floors and budget, at most 64)
    failed = _failed(res)
    assert set(failed) == keys, failed
    for k in keys:
        assert check in failed[k], failed  # caught by the cheap check named ...
        assert set(failed[k]) - {"recompute"}, failed  # ... without the recompute
        assert "recompute" in failed[k], failed  # and by the recompute
    assert not res.ok


DEFAULT_8BIT = {"int8_shards": {"hidden.layout": "shards"},  # both final states, as the bf16 store has
                "fp8_speculators_files": {"hidden.layout": "speculators"}}
_CLEAN8: dict[str, object] = {}


def _clean8(tmp_path_factory, which):
    """04's clean store of the same run in a layout's default 8-bit storage (`default_storage`: int8/channel_rms for
    shards, speculators' FP8 files for speculators, since the ablation), not verified yet. Do not change it."""
    if which not in _CLEAN8:
        over = DEFAULT_8BIT[which]
        fmt, scale = default_storage(over["hidden.layout"])
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("RANK", raising=False)
            mp.delenv("WORLD_SIZE", raising=False)
            p = _make_run(tmp_path_factory.mktemp(f"verify_{which}"),
                          **over, **{"hidden.storage": fmt, "hidden.storage_scale": scale})
            res = run_extract(p, progress=False, model=_model(p))
        assert res.merged and res.validation.ok and HiddenReader(hidden_dir(p)).codec.quantized
        _CLEAN8[which] = p
    return _CLEAN8[which]


def _unchanged(hs, rows, mask):
    pass


@pytest.mark.parametrize("store", list(DEFAULT_8BIT))
@pytest.mark.parametrize("kind", ["unchanged", *MUTATIONS])
def test_each_mutation_in_the_default_8bit_store_flags_its_sample_and_no_other(clean, tmp_path_factory, tmp_path,
                                                                                kind, store):
    """The same faults in the stores 04 writes by default (shards: int8/channel_rms; speculators: its FP8 files), made
    where an engine makes them: in the states as captured, before 04 quantizes them (a shard's scales and channel
    statistics then describe the faulty block). Each is caught in its sample alone by the same cheap check as in bf16
    and by the recompute within the stored step; the clean states written the same way pass every check."""
    global _HEAD
    if _HEAD is None:
        _HEAD = load_head(resolve_model_path(clean.model.path), load_config(clean))
    change, keys, check = MUTATIONS[kind] if kind != "unchanged" else (_unchanged, set(), None)
    src = _clean8(tmp_path_factory, store)
    fmt, scale = default_storage(DEFAULT_8BIT[store]["hidden.layout"])
    p = _copy(src, tmp_path, **DEFAULT_8BIT[store], **{"hidden.storage": fmt, "hidden.storage_scale": scale})
    _mutate_before_storing(p, clean, change)
    res = _verify(p, recompute="all")
    failed = _failed(res)
    assert set(failed) == keys, failed
    for k in keys:
        assert check in failed[k], failed
        assert set(failed[k]) - {"recompute"}, failed
        assert "recompute" in failed[k], failed
    assert res.ok is (kind == "unchanged") and res.summary["recomputed"] == 8


def test_a_store_whose_final_states_are_all_wrong_fails_the_pooled_head(clean, tmp_path):
    """Every sample shifted by one position (a store off by one throughout): each sample fails its logit z, and the
    run fails the pooled exact head (top-1 and log-prob), which no single sample has enough positions for."""
    p = _copy(clean, tmp_path)

    def shift_all(hs, rows, mask):
        for a, n in rows.values():
            hs[a:a + n] = torch.roll(hs[a:a + n].clone(), -1, dims=0)

    _mutate(p, shift_all)
    res = _verify(p)
    assert all("head_logit_z" in f for f in _failed(res).values()) and len(_failed(res)) == 8
    assert {x["check"] for x in res.store_problems} == {"head_top1", "head_logprob"}
    assert res.summary["checks"]["run_head_top1"]["failed"] == 1 and not res.ok
    assert "head_top1: the run's greedy records" in res.failed_table().to_string()


@pytest.mark.parametrize("layout,final_state", [("specforge", "post_norm"), ("speculators", "pre_norm")])
def test_a_store_in_each_trainer_layout_passes(tmp_path, monkeypatch, layout, final_state):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = _make_run(tmp_path, **{"hidden.layout": layout, "hidden.final_state": final_state,
                               "hidden.verify_after": True, "hidden.verify_positions": 0})
    res = run_extract(p, progress=False, model=_model(p))
    ver = res.verification
    assert ver is not None and ver.ok and _failed(ver) == {}, _failed(ver)
    assert ver.summary["layout"] == layout and ver.summary["states"][-1] == final_state
    assert ver.summary["recomputed"] >= 1


@pytest.mark.parametrize("over", [{"hidden.storage": "int8"},  # channel_rms, the measured best
                                  {"hidden.storage": "fp8_e4m3", "hidden.final_storage": "bf16"},
                                  {"hidden.storage": "fp8_e4m3", "hidden.storage_scale": "token",
                                   "hidden.layout": "speculators", "hidden.final_state": "pre_norm"}],
                         ids=["int8", "fp8_bf16_final", "fp8_speculators_files"])
def test_an_8bit_store_is_recomputed_within_its_own_step(tmp_path, monkeypatch, over):
    """An 8-bit store differs from a fresh forward by its quantization step (`StateCodec.error_bound`, from the
    stored scales and channels, or from a trainer's decoded FP8 file): 04's own verification of a clean 8-bit store
    passes (it failed every recomputed sample before), and a swap of two same-length samples' values and scales is
    still caught by the recompute, those two and no other."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = _make_run(tmp_path, **over, **{"hidden.verify_after": True})
    res = run_extract(p, progress=False, model=_model(p))
    assert res.verification is not None and res.verification.ok, _failed(res.verification)
    ver = _verify(p, recompute="all")
    assert _failed(ver) == {} and ver.summary["recomputed"] == 8
    worst = max(v["off_share"] for r in ver.rows for v in r["recompute"].values())
    assert worst <= 1e-3
    if over.get("hidden.layout") == "speculators":
        return
    rd = HiddenReader(hidden_dir(p))
    (shard,) = set(rd.index["shard"])
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = hidden_dir(p) / shard
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(path))
    (a, n), (b, m) = [(int(rd.index.iloc[rd.row(k)]["offset"]), int(rd.index.iloc[rd.row(k)]["length"]))
                      for k in (SAME_A, SAME_B)]
    assert n == m
    for name in rd.codec.token_tensors():  # the values and their scales: another request's states, as stored
        x = t[name][a:a + n].clone()
        t[name][a:a + n] = t[name][b:b + n]
        t[name][b:b + n] = x
    save_file(t, str(path), metadata=meta)
    as_written(hidden_dir(p), path)
    failed = _failed(_verify(p, recompute="all"))
    assert set(failed) == {SAME_A, SAME_B} and all("recompute" in v for v in failed.values()), failed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_target_is_recomputed_within_its_own_forwards_noise(tmp_path, monkeypatch, dtype):
    """A target run in bf16 (what a GPU run uses) or fp16 differs from itself with the batch's shape: 04's padded
    batches against the recompute's one sequence put 40% of a bf16 store's elements beyond the storage tolerance,
    so 04's own verification failed 6 of the 8 clean samples. The tolerance is now the compute dtype's where that is
    looser (`COMPUTE_TOL`): the clean store passes, and a swap of two same-length samples' states is still caught."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = _make_run(tmp_path, **{"model.dtype": dtype, "hidden.dtype": dtype, "hidden.verify_after": True,
                               "hidden.verify_recompute": 8})
    res = run_extract(p, progress=False)  # the target as 04 loads it, in the params' dtype
    ver = res.verification
    assert ver.ok and ver.summary["recomputed"] == 8 and ver.summary["compute_dtype"] == dtype, _failed(ver)
    _mutate(p, m_swap_samples)
    cfg = load_config(p)
    make = BACKENDS["hf"](p, HiddenReader(hidden_dir(p)).info, cfg)
    failed = _failed(verify_store(p, config=cfg, backend=make, recompute="all", positions=DEFAULT_POSITIONS))
    assert set(failed) == {SAME_A, SAME_B} and all("recompute" in v for v in failed.values()), failed


def test_records_sampled_hotter_than_the_measured_floor_are_judged_against_the_run(clean, tmp_path):
    """The same states, their records saying temperature 1.3: no sample is greedy any more, each output z is judged
    against the run alone (counted in the summary and said in the line), and the clean store still passes."""
    p = _copy(clean, tmp_path)
    for f in (p.run_dir / "records").glob("*.jsonl"):
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        f.write_text("".join(json.dumps(r | {"sampling": r["sampling"] | {"temperature": 1.3}}) + "\n" for r in rows))
    res = _verify(p)
    assert res.ok and res.summary["out_z_run_only"] == res.summary["samples"] == 8
    assert not any(r["greedy"] for r in res.rows) and res.summary["checks"]["run_head_top1"]["applicable"] == 0
    assert "the output z of 8 samples sampled hotter than temperature 1 (or not by the target) judged against the run alone" in res.line()
    assert "judged against the run alone" not in _verify(_copy(clean, tmp_path / "greedy")).line()


def test_cli_exit_status_and_bad_input(clean, tmp_path, capsys):
    p = _copy(clean, tmp_path)
    run = str(p.run_dir)
    assert cli_main(["verify-hidden", run, "--recompute", "0", "--positions", "64"]) == 0
    assert "8 samples, 0 failed" in capsys.readouterr().out
    for k in ("8", "63", "-1"):  # below the floors the limits were measured at: false failures, so refused in one line
        assert cli_main(["verify-hidden", run, "--recompute", "0", "--positions", k]) == 2
        assert f"verify-hidden --positions {k}: must be 0 (every position) or at least 64" in capsys.readouterr().err
    _mutate(p, m_zero)
    out = tmp_path / "lines.jsonl"
    assert cli_main(["verify-hidden", run, "--recompute", "1", "--out", str(out)]) == 1
    assert f"FAIL {TARGET}: flat_rows" in capsys.readouterr().out
    assert len(out.read_bytes().splitlines()) == 8
    assert cli_main(["verify-hidden", run, "--recompute", "some"]) == 2
    assert "verify-hidden --recompute 'some'" in capsys.readouterr().err
    assert cli_main(["verify-hidden", str(tmp_path / "nowhere")]) == 2
    with pytest.raises(Exception):
        parse_recompute("-1")


def test_export_refuses_an_unverified_or_failing_store_unless_allowed(clean, tmp_path):
    p = _copy(clean, tmp_path)
    with pytest.raises(ExportError, match="unverified.*verify-hidden"):
        export_format(p, tmp_path / "out", "speculators")
    _mutate(p, m_nan)
    assert not _verify(p).ok
    with pytest.raises(ExportError, match="FAILED"):
        export_format(p, tmp_path / "out", "speculators")
    allowed = load_params(REPO / "tests" / "fixtures" / "nbval.yaml",
                          {"output_root": str(p.output_root), "export.allow_unverified": True, "hidden.storage": "bf16"})
    m = export_format(allowed, tmp_path / "out", "speculators")
    assert "exported anyway (export.allow_unverified)" in m["selection"]["hidden_verification"]


def test_verification_uses_only_the_head_tensors_of_the_checkpoint(clean):
    head = load_head(resolve_model_path(clean.model.path), load_config(clean))
    assert head.tensors == ("model.norm.weight", "model.embed_tokens.weight")  # SmolLM2 ties its head
    assert tuple(head.lm_head.shape) == (49152, 576)


def stat_figures(hs, names):
    """`chunk_figures` of one sample (the states of one sample alone)."""
    from eagle3data.hidden.verify.checks import chunk_figures

    return chunk_figures(hs, names, [(0, len(hs))])[0]


def test_the_fused_figures_equal_the_element_wise_ones():
    """chunk_figures decides flat rows, duplicate layers and NaN from each row's norm and first element, then checks
    only the suspects: the counts equal the element-wise ones on a tensor with each planted."""

    g = torch.Generator().manual_seed(0)
    hs = (torch.randn(40, 5, 96, generator=g) * 3).to(torch.bfloat16)
    hs[7, 1] = 0
    hs[9, 4] = 2.5  # constant, not zero
    hs[11, 0, :95] = 1.0  # all but one equal: not flat
    hs[12, 1] = -1.0
    hs[12, 1, 40] = 1.0  # every |x| equal, so its norm is |first| sqrt(hidden): a suspect, and not flat
    hs[:, 3] = hs[:, 2]
    hs[5, 0, 3] = float("nan")
    hs[6, 2, 0] = float("inf")  # layers 2 and 3 now differ in one element
    names = ("aux_low", "aux_mid", "aux_high", "pre_norm", "post_norm")
    fig = stat_figures(hs, names)
    x = torch.nan_to_num(hs.float(), nan=0.0, posinf=0.0, neginf=0.0)
    assert fig["nonfinite"] == int((~torch.isfinite(hs.float())).sum()) == 2
    assert fig["flat_rows"] == int(((x.amax(-1) - x.amin(-1)) == 0).sum()) == 2
    assert fig["duplicate_layers"] == []
    hs[6, 2, 0] = hs[6, 3, 0]
    assert stat_figures(hs, names)["duplicate_layers"] == [["aux_high", "pre_norm"]]


def test_many_samples_reduced_at_once_give_each_its_own_figures():
    """chunk_figures over consecutive samples (as verify reduces a chunk of the store) gives every sample exactly
    the figures it has alone, so a defect planted in one sample shows in that sample and no other."""
    from eagle3data.hidden.verify.checks import chunk_figures

    g = torch.Generator().manual_seed(1)
    names = ("aux_low", "aux_mid", "aux_high", "pre_norm", "post_norm")
    parts = [(torch.randn(n, 5, 64, generator=g) * (1 + i)).to(torch.bfloat16) for i, n in enumerate((9, 1, 14, 6))]
    parts[0][3, 2] = 0  # a zeroed row in the first
    parts[2][:, 4] = parts[2][:, 1]  # a layer stored twice in the third
    parts[3][2, 0, 5] = float("nan")  # NaN in the last
    spans, at = [], 0
    for t in parts:
        spans.append((at, len(t)))
        at += len(t)
    figs = chunk_figures(torch.cat(parts), names, spans)
    assert figs == [stat_figures(t, names) for t in parts]
    assert [f["flat_rows"] for f in figs] == [1, 0, 0, 0] and [f["nonfinite"] for f in figs] == [0, 0, 0, 1]
    assert [f["duplicate_layers"] for f in figs] == [[], [], [["aux_mid", "post_norm"]], []]
    assert chunk_figures(torch.cat(parts), names, spans[1:3]) == figs[1:3]  # a subset of the rows: theirs only


def test_the_reader_streams_whole_samples_in_runs_of_bounded_size(clean):
    """HiddenReader.chunks hands out consecutive whole samples (each at its row), never more than max_bytes stored
    unless one sample is larger; every sample once, equal to what iterating the reader gives."""
    rd = HiddenReader(hidden_dir(clean))
    alone = list(rd)
    per_token = rd.codec.bytes_per_token(int(rd.info["hidden_size"]))
    cap = 3 * max(s["length"] for s in alone) * per_token
    got = []
    for rows, part in rd.chunks(cap):
        assert len(part["hidden_states"]) * per_token <= cap or len(rows) == 1
        for r in rows:
            got.append((r["key"], part["hidden_states"][r["at"]:r["at"] + r["length"]],
                        part["input_ids"][r["at"]:r["at"] + r["length"]]))
    assert len(list(rd.chunks(cap))) > 1
    assert [k for k, _, _ in got] == [s["key"] for s in alone]
    for (_, hs, ids), s in zip(got, alone):
        assert torch.equal(hs, s["hidden_states"]) and torch.equal(ids, s["input_ids"])


def test_head_positions_have_floors_a_budget_and_a_cap():
    from eagle3data.core.params.hidden import Z_OUT_FLOOR, Z_PROMPT_FLOOR
    from eagle3data.hidden.verify.checks import (EXACT_RUN_FLOOR, HEAD_FLOPS_PER_BYTE, binom_tail, exact_plan,
                                                 head_counts, top1_limit, TOP1_ALPHA, TOP1_CLEAN_MISS)

    hidden, vocab, tok = 576, 49152, 5760
    assert head_counts(100 * tok, hidden, 64) == (Z_OUT_FLOOR, Z_PROMPT_FLOOR)  # short: the floors
    z_bytes = int(48 * 2 * hidden * hidden / HEAD_FLOPS_PER_BYTE) + 1  # buys 48 z positions
    assert head_counts(z_bytes, hidden, 64) == (max(48, Z_OUT_FLOOR), max(48, Z_PROMPT_FLOOR))
    assert head_counts(10 ** 12, hidden, 8) == (8, 8) and head_counts(tok, hidden, 0) == (0, 0)  # the cap; 0 = all
    # exact positions, planned over the run: the run floor shared by length, then the budget, each at most its room
    short = exact_plan([100] * 4, [50] * 4, tok, hidden, vocab, 64)
    assert sum(short) == EXACT_RUN_FLOOR and short == [2, 2, 2, 2]
    assert exact_plan([300, 100], [200, 1], tok, hidden, vocab, 64) == [EXACT_RUN_FLOOR - 1, 1]  # no room: the rest
    per = 2 * hidden * vocab / (HEAD_FLOPS_PER_BYTE * tok)  # tokens that buy one exact position
    long = exact_plan([int(30 * per), int(10 * per)], [1000, 1000], tok, hidden, vocab, 64)  # 39.99: 39 to share
    assert long == [29, 10]  # 29.25 and 9.75 by length; the one left goes to the larger remainder
    assert exact_plan([10 ** 6], [10 ** 6], tok, hidden, vocab, 8) == [8]  # the cap
    assert exact_plan([100, 100], [40, 7], tok, hidden, vocab, 0) == [40, 7]  # 0: every output position
    assert exact_plan([100], [0], tok, hidden, vocab, 64) == [0]
    for k in (4, 8, 16, 64):  # the top-1 limit: a clean sample reaches it with probability <= alpha, one fewer does not
        m = top1_limit(k)
        assert binom_tail(k, TOP1_CLEAN_MISS, m) <= TOP1_ALPHA < binom_tail(k, TOP1_CLEAN_MISS, m - 1)


def test_the_pooled_top1_limit_holds_at_a_13tb_stores_count_of_positions():
    """The run's pooled top-1 check at the exact positions a large store buys (13 TB of Kimi: about 55,000; the
    embedded run at --positions 0: 2,310): the binomial tail neither overflows a float (it did past ~1,030
    positions) nor drifts from exact rational arithmetic."""
    import math
    from fractions import Fraction

    from eagle3data.hidden.verify.checks import TOP1_ALPHA, TOP1_CLEAN_MISS, binom_tail, top1_limit

    def exact(k, q, m):
        q = Fraction(q)
        return float(sum(math.comb(k, j) * q ** j * (1 - q) ** (k - j) for j in range(m, k + 1)))

    for k, m in ((8, 3), (500, 25), (500, 124), (1100, 60)):
        assert binom_tail(k, TOP1_CLEAN_MISS, m) == pytest.approx(exact(k, TOP1_CLEAN_MISS, m), rel=1e-9)
    for k in (2310, 55_000):
        m = top1_limit(k)
        assert binom_tail(k, TOP1_CLEAN_MISS, m) <= TOP1_ALPHA < binom_tail(k, TOP1_CLEAN_MISS, m - 1)
        assert TOP1_CLEAN_MISS * k < m < 2 * TOP1_CLEAN_MISS * k  # a few SDs above the clean mean


def test_sampled_records_are_judged_by_their_own_floors():
    """A sampled record's next token is the sampler's choice: its z floor is the lower one measured on a temperature-1
    run (none above that temperature: the run's spread alone), and its log-prob is judged only against the run (the
    pooled check takes greedy records alone)."""
    from eagle3data.hidden.verify.checks import MIN_OUT_Z, MIN_SAMPLED_OUT_Z, judge, run_head_problems

    base = {"nonfinite": 0, "flat_rows": 0, "duplicate_layers": [], "out_exact_positions": 16, "out_misses": 0,
            "out_logprob_median": -6.0, "out_logprob_mean": -6.5, "out_z_mean": (MIN_OUT_Z + MIN_SAMPLED_OUT_Z) / 2}
    assert judge(base, {}, greedy=False, judge_profile=False)[0] == []
    assert judge(base, {}, greedy=True, judge_profile=False)[0] == ["head_logprob", "head_logit_z"]
    low = base | {"out_z_mean": MIN_SAMPLED_OUT_Z - 0.1}
    assert judge(low, {}, greedy=False, judge_profile=False)[0] == ["head_logit_z"]
    # the floor is measured up to temperature 1: a hotter sampler's clean means reach below it, so the run judges alone
    assert judge(low, {}, greedy=False, judge_profile=False, temperature=1.0)[0] == ["head_logit_z"]
    assert judge(low, {}, greedy=False, judge_profile=False, temperature=1.3)[0] == []
    stats = {"out_z_mean": {"": (3.5, 0.8)}}  # the run's centre and spread: far below it still fails
    assert judge(base | {"out_z_mean": -1.0}, stats, greedy=False, judge_profile=True, temperature=1.3)[0] == \
        ["head_logit_z"]
    rows = [{"greedy": False, "out_exact_positions": 1, "out_misses": 1, "out_logprob_mean": -7.0}] * 8
    assert run_head_problems(rows) == []
    assert {p["check"] for p in run_head_problems([r | {"greedy": True} for r in rows])} == {"head_top1", "head_logprob"}
    from eagle3data.hidden.verify.run import _head_use  # the summary's pooled figures are the greedy records' too

    mixed = [r | {"log_rms": {}} for r in rows] + [{"greedy": True, "log_rms": {}, "out_exact_positions": 3,
                                                      "out_misses": 0, "out_logprob_mean": -0.5}]
    use = _head_use(mixed)
    assert use["pooled_greedy_logprob_mean"] == -0.5 and use["pooled_greedy_top1"] == 1.0
    assert use["exact_positions"] == 11


def test_prompt_positions_start_after_the_prefix_another_sample_shares():
    """A system prompt, a template or the earlier turns shared with another sample give the same states in both:
    the prompt check draws after the longest prefix any other sample shares (a whole-prefix turn: none)."""
    from eagle3data.hidden.verify.checks import unique_starts

    sys_prompt = [1, 2, 3, 4]
    got = unique_starts({"a": sys_prompt + [9, 9, 9], "b": sys_prompt + [7, 7], "c": [5, 6, 7],
                         "turn0": [8, 8, 8, 1], "turn1": [8, 8, 8, 1, 2, 2]})
    assert got == {"a": 4, "b": 4, "c": 0, "turn0": 4, "turn1": 4}


def test_the_heads_top1_and_logprob_are_argmax_and_log_softmax():
    """The exact head's reductions, blocked while in cache (`_argmax_logsumexp`), equal torch's argmax and
    log_softmax on every row, at a row count that is no multiple of the block."""
    from eagle3data.hidden.verify.head import LSE_ROWS, _argmax_logsumexp

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2 * LSE_ROWS + 5, 4099, generator=g) * 4
    logits[3, 17] = 60.0  # one row dominated by one logit (its exp(. - max) sums to ~1)
    best, lse = _argmax_logsumexp(logits)
    assert torch.equal(best, logits.argmax(1))
    tgt = torch.randint(0, 4099, (len(logits),), generator=g)
    lp = logits.gather(1, tgt[:, None])[:, 0] - lse
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, tgt[:, None])[:, 0], rtol=0, atol=2e-5)


def test_the_logit_z_is_the_one_the_whole_head_gives(clean):
    """Head.logit_z (2 x hidden^2 FLOPs) equals (logit - mean) / std over the vocabulary of the full logits (2 x
    hidden x vocab), and Cantelli's bound on the share of the vocabulary at or above the target holds."""
    head = load_head(resolve_model_path(clean.model.path), load_config(clean))
    smp = next(iter(HiddenReader(hidden_dir(clean))))
    post = smp["hidden_states"][:, -1].float()  # the fixture store ends with post_norm
    tgt = smp["input_ids"][1:].long()
    post = torch.cat([post[:-1], torch.randn(8, post.shape[1]) * 3])  # and states the model never made
    tgt = torch.cat([tgt, torch.randint(0, head.lm_head.shape[0], (8,))])
    logits = (post.double() @ head.lm_head.double().T)
    want = (logits.gather(1, tgt[:, None])[:, 0] - logits.mean(1)) / logits.std(1, unbiased=False)
    got = head.logit_z(post, tgt)
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=1e-3)  # the std's GEMM is bfloat16 (0.1%)
    at_or_above = (logits >= logits.gather(1, tgt[:, None])).double().mean(1)
    pos = got > 0
    assert bool((at_or_above[pos] <= 1 / (1 + got[pos].double() ** 2) + 1e-9).all())


def test_merge_only_keeps_the_verification_of_the_same_store_and_drops_it_otherwise(clean, tmp_path, capsys):
    from eagle3data.hidden.extract import merge_index

    p = _copy(clean, tmp_path)
    res = _verify(p)
    assert res.ok
    info = lambda: orjson.loads((hidden_dir(p) / "index.json").read_bytes())  # noqa: E731
    ver = info()["verification"]
    merge_index(p)  # what `extract --merge-only` does
    assert info()["verification"] == ver
    export_format(p, tmp_path / "out", "speculators")  # 05 still takes it
    _mutate(p, m_zero)  # a shard rewritten after the verification
    merge_index(p)
    assert "verification" not in info()
    with pytest.raises(ExportError, match="unverified"):
        export_format(p, tmp_path / "out2", "speculators")


def test_the_summary_table_and_the_report_show_no_nan(clean, tmp_path):
    from eagle3data.audit.report import verification_html

    p = _copy(clean, tmp_path)
    res = _verify(p)
    t = res.table()
    assert t.loc["coverage", "upper95"] == "" and t.loc["finite", "upper95"] == f"{3 / 8:.2%}"
    assert not [v for v in t["upper95"] if "nan" in v.lower()]
    assert "nan%" not in verification_html(res.summary).lower()


def test_the_head_applies_the_models_own_final_norm_kind(tmp_path):
    """A Gemma-style checkpoint stores w and multiplies by 1 + w: verify's head must too (hidden/norms.py)."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from eagle3data.hidden.verify.head import load_head

    w = torch.linspace(-0.5, 0.5, 8)
    save_file({"model.norm.weight": w, "lm_head.weight": torch.randn(16, 8)}, str(tmp_path / "model.safetensors"))
    x = torch.randn(3, 8)
    for model_type, mult in (("llama", w), ("gemma2", 1.0 + w)):
        head = load_head(tmp_path, SimpleNamespace(model_type=model_type, rms_norm_eps=1e-6))
        want = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * mult
        torch.testing.assert_close(head.norm(x), want)


def test_a_multimodal_targets_head_takes_its_norm_from_the_text_config(tmp_path):
    """Kimi-K2.5 is multimodal: its config keeps `rms_norm_eps` in `text_config`, its tensors sit under
    `language_model.` beside a vision tower's own norms. The head must take the text model's eps (not a 1e-6
    default) and the final norm of the text's hidden size (not the vision tower's), as the vLLM backend's post-norm
    state does (`engines.vllm_capture.final_norm`: the same reader)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from eagle3data.hidden.verify.head import load_head
    from eagle3data.hidden.norms import read_final_norm
    from eagle3data.hidden.engines.vllm_capture import norm_kind

    h, v = 8, 16
    w = torch.linspace(0.5, 1.5, h)
    save_file({"vision_tower.encoder.final_layernorm.weight": torch.ones(12), "vision_tower.norm.weight": torch.ones(12),
               "language_model.model.norm.weight": w, "language_model.lm_head.weight": torch.randn(v, h),
               "language_model.model.layers.0.input_layernorm.weight": torch.ones(h)},
              str(tmp_path / "model.safetensors"))
    cfg = transformers.LlavaConfig(text_config={"model_type": "llama", "hidden_size": h, "num_attention_heads": 2,
                                                "rms_norm_eps": 1e-3, "vocab_size": v, "tie_word_embeddings": False})
    assert getattr(cfg, "rms_norm_eps", None) is None  # the shape this guards: nothing at the top level
    head = load_head(tmp_path, cfg)
    assert head.eps == 1e-3 and head.tensors == ("language_model.model.norm.weight", "language_model.lm_head.weight")
    x = torch.full((2, h), 0.01)  # mean square 1e-4: eps 1e-3 and 1e-6 give norms 3.3x apart
    torch.testing.assert_close(head.norm(x), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-3) * w)
    assert norm_kind(cfg) == "rms" and torch.equal(read_final_norm(tmp_path, cfg).multiplier, head.norm_weight)


def test_the_bench_verifies_a_linked_copy_and_leaves_the_run_as_it_was(clean, tmp_path):
    """bench_verify measures the embedded run through hard links (`linked_copy`): verify's writes (lines, summary,
    index.json's entry) land in the copy; the run's own files keep their bytes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_verify_module", REPO / "bench" / "bench_verify.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    p = _copy(clean, tmp_path)
    _verify(p)  # the run as make run leaves it: verified once
    hdir = hidden_dir(p)
    before = {f.name: f.read_bytes() for f in hdir.iterdir() if f.is_file()}
    dst = bench.linked_copy(p.run_dir, tmp_path / "bench" / p.run_name)
    assert (dst / "hidden" / "index.json").stat().st_ino == (hdir / "index.json").stat().st_ino  # links, not copies
    q = load_params(REPO / "tests" / "fixtures" / "nbval.yaml",
                    {"output_root": str(tmp_path / "bench"), "hidden.probe_batches": 0, "hidden.verify_after": False,
                     "hidden.storage": "bf16"})
    res = _verify(q)
    assert res.ok and res.lines_path.parent == dst / "hidden"
    assert {f.name: f.read_bytes() for f in hdir.iterdir() if f.is_file()} == before
    assert (dst / "hidden" / "index.json").read_bytes() != before["index.json"]  # its own verified_at


# ---------------------------------------------------------------------------- damaged files (issue 43 item 4)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The fixture run stored one sample per shard (a shard cap of 1 byte), 04's own verification passed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RANK", raising=False)
        mp.delenv("WORLD_SIZE", raising=False)
        p = _make_run(tmp_path_factory.mktemp("sharded"), **{"hidden.shard_bytes": 1, "hidden.verify_after": True})
        res = run_extract(p, progress=False, model=_model(p))
    assert res.merged and res.verification.ok and len(set(HiddenReader(hidden_dir(p)).index["shard"])) == 8
    return p


def _copy_sharded(p, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(p.run_dir, dst / p.run_name)
    return load_params(REPO / "tests" / "fixtures" / "nbval.yaml",
                       {"output_root": str(dst), "hidden.probe_batches": 0, "hidden.shard_bytes": 1,
                        "hidden.storage": "bf16"})


def test_04_records_a_content_checksum_per_file(sharded, tmp_path):
    from eagle3data.hidden.store.checksum import JOURNAL_DIR, file_checksum, journaled

    rd = HiddenReader(hidden_dir(sharded))
    sums = rd.checksums()
    assert rd.checksummed and rd.info["checksum"] == "xxh3_128" and len(sums) == 8
    assert all(sums[f] == file_checksum(hidden_dir(sharded) / f) for f in sums)
    assert journaled(hidden_dir(sharded)) == sums  # what the writers journaled, one line per file
    # a file whose journal line was lost (a crash between its rename and the line) is hashed at the merge
    p = _copy_sharded(sharded, tmp_path)
    hdir = hidden_dir(p)
    (journal,) = (hdir / JOURNAL_DIR).iterdir()
    journal.write_bytes(b"".join(journal.read_bytes().splitlines(keepends=True)[1:]))
    assert cli_main(["extract", str(REPO / "tests" / "fixtures" / "nbval.yaml"), "--merge-only",
                     "-p", "output_root", str(p.output_root), "-p", "hidden.storage", "bf16"]) == 0
    assert HiddenReader(hdir).checksums() == sums


def _shard_of(p, key):
    rd = HiddenReader(hidden_dir(p))
    return rd.index.iloc[rd.row(key)]["shard"]


def test_a_truncated_shard_is_one_line_and_the_other_shards_are_judged(sharded, tmp_path, capsys):
    p = _copy_sharded(sharded, tmp_path)
    shard = _shard_of(p, TARGET)
    path = hidden_dir(p) / shard
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # an interrupted copy
    assert cli_main(["export", str(p.run_dir), "--format", "speculators", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: ") and TARGET in err[0], err
    assert "Traceback" not in err[0] and not (tmp_path / "x" / "hidden_states").exists()
    assert cli_main(["verify-hidden", str(p.run_dir), "--recompute", "0"]) == 1
    cap = capsys.readouterr()
    assert "Traceback" not in cap.out + cap.err
    lines = cap.out.splitlines()
    named = [x for x in lines if str(path) in x]
    assert len(named) == 1 and "does not open (SafetensorError" in named[0] and TARGET in named[0], lines
    rows = [orjson.loads(x) for x in (hidden_dir(p) / "verify.jsonl").read_bytes().splitlines()]
    assert {r["key"]: r["failed"] for r in rows if r["failed"]} == {TARGET: ["readable"]}
    judged = [r for r in rows if "log_rms" in r]
    assert len(rows) == 8 and len(judged) == 7 and TARGET not in {r["key"] for r in judged}  # the others, judged


@pytest.mark.parametrize("layout", ["shards", "speculators"])
def test_4k_flipped_inside_a_file_fails_exactly_its_samples_by_checksum(sharded, tmp_path, monkeypatch, capsys,
                                                                        layout):
    if layout == "shards":
        p = _copy_sharded(sharded, tmp_path)
    else:  # a trainer's per-sample files: each its own checksum
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        p = _make_run(tmp_path, **{"hidden.layout": layout, "hidden.final_state": "pre_norm",
                                   "hidden.verify_after": True})
        assert run_extract(p, progress=False, model=_model(p)).verification.ok
    path = hidden_dir(p) / _shard_of(p, TARGET)
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = bytes(b ^ 0xFF for b in data[mid:mid + 4096])  # bit rot, a bad copy: same size
    path.write_bytes(bytes(data))
    # 05 checks before it links or converts (the verification 04 recorded passed, before the damage)
    assert cli_main(["export", str(p.run_dir), "--format", "speculators", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: checksum ") and TARGET in err[0], err
    assert not (tmp_path / "x" / "hidden_states").exists()
    res = _verify(p)
    assert _failed(res) == {TARGET: ["checksum"]}, _failed(res)  # the statistical checks alone saw nothing
    assert res.summary["checks"]["checksum"] == {**res.summary["checks"]["checksum"], "applicable": 8, "failed": 1}
    (why,) = res.summary["file_problems"][_shard_of(p, TARGET)]
    assert why.startswith(f"{path}: checksum ") and TARGET in why


def test_a_store_written_before_checksums_is_read_and_said_not_checksummed(clean, tmp_path):
    import pyarrow.parquet as pq

    from eagle3data.hidden.store.checksum import JOURNAL_DIR

    p = _copy(clean, tmp_path)
    hdir = hidden_dir(p)
    shutil.rmtree(hdir / JOURNAL_DIR)
    t = pq.read_table(hdir / "index.parquet")
    pq.write_table(t.drop_columns(["checksum"]), hdir / "index.parquet")
    info = orjson.loads((hdir / "index.json").read_bytes())
    (hdir / "index.json").write_bytes(orjson.dumps({k: v for k, v in info.items() if k != "checksum"}))
    rd = HiddenReader(hdir)
    assert not rd.checksummed and set(rd.checksums().values()) == {None}
    res = _verify(p)
    assert res.ok and res.summary["checks"]["checksum"]["applicable"] == 0
    assert "; not checksummed (a store written before checksums)" in res.line()
    assert "not checksummed" not in _verify(_copy(clean, tmp_path / "new")).line()
