"""06's `online` variant: the draft trained on an online hand-off (ids, no states) with every row's states generated
during training by a real vLLM CPU server (04's command, the project's CPU connector), through speculators' own
dataset, client and hs-connectors' file backend: every echoed id checked, the states compared with 04's store of the
same key within verify-hidden's recompute tolerance, and the training close to the same training on the store.

The run is the ci run (SmolLM2 embedded, 4 samples) through 04 (speculators' layout, bf16) and 05's `speculators`
and `speculators_online` hand-offs (`run_export`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3data.export.run import run_export
from eagle3data.generate.backends.vllm_server import free_port, model_dir
from eagle3data.value.online import ONLINE_HANDOFF, StoreCheck, online_handoff, states_server_command, train_online
from eagle3data.value.run import plan_value
from eagle3data.value.train import TrainConfig, ValueStageError, layer_ids_of_store, train_draft
from eagle3data.value.variants import VARIANTS, variant_data
from runfiles import ci_records_through_04

REPO = Path(__file__).resolve().parents[1]
CFG = TrainConfig(epochs=2, total_seq_len=512, checkpoint_every=50)


@pytest.fixture(scope="module")
def run(ci_run, tmp_path_factory):
    p = ci_records_through_04(ci_run, tmp_path_factory.mktemp("online"))
    ex = run_export(p, formats=["speculators", "speculators_online"])  # 05: the offline and the online hand-off
    assert ex.manifests["speculators_online"]["handoff"]["window"]["dropped"] == []
    return p


def _keys(h: Path) -> list[str]:
    return [str(k) for k in json.loads((h / "handoff.json").read_text())["keys"]]


def test_the_online_handoff_is_checked_and_trained_in_exacts_row_order(run):
    p = run
    assert "online" in VARIANTS
    shutil.copytree(p.run_dir / "export" / "speculators", p.run_dir / "x" / ONLINE_HANDOFF)
    with pytest.raises(ValueStageError, match="stored state files"):  # the offline hand-off is not an online one
        online_handoff(p.run_dir / "x")
    # the plan refuses the variant without the online hand-off before any variant trains
    pv = p.model_copy(update={"value": p.value.model_copy(update={"variants": ["exact", "online"], "eval": p.value.eval
                                                                  .model_copy(update={"humaneval": 0})})})
    assert plan_value(pv).variants == ["exact", "online"]
    moved = p.run_dir / "export" / "moved"
    (p.run_dir / ONLINE_HANDOFF).rename(moved)
    try:
        with pytest.raises(ValueStageError, match="no online hand-off"):
            plan_value(pv)
    finally:
        moved.rename(p.run_dir / ONLINE_HANDOFF)
    exact = p.run_dir / "export" / "speculators"
    keys = _keys(exact)
    order = [keys[i] for i in (2, 0, 3, 1)]
    vd = variant_data(p, "online", exact, [2, 0, 3, 1], order, say=lambda s: None)
    assert vd.handoff == p.run_dir / ONLINE_HANDOFF and [_keys(vd.handoff)[i] for i in vd.rows] == order
    # the states server is 04's command: extract_hidden_states at the store's layers + N, the CPU connector
    cmd = states_server_command(p, p.run_dir / "files")
    spec = json.loads(cmd.argv[cmd.argv.index("--speculative-config") + 1])
    kv = json.loads(cmd.argv[cmd.argv.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    assert kv["kv_connector"] == "CPUHiddenStatesConnector" and kv["kv_connector_module_path"] == "cpu_hidden_states"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(p.run_dir / "files")


def test_the_store_comparison_passes_the_stores_own_states_and_fails_shifted_ones(run):
    p = run
    check = StoreCheck(p)
    key = check.reader.keys()[0]
    s = check.reader.sample(key)
    ids = [int(x) for x in s["input_ids"].tolist()]
    hs = s["hidden_states"][:, :4].float()  # aux layers + pre_norm: what the engine's file holds
    assert check.names == ["aux_low", "aux_mid", "aux_high", "pre_norm", "post_norm"]
    same = check.compare(key, ids, hs)
    assert same["ok"] and same["ids_equal"], same
    late = check.compare(key, ids, torch.roll(hs, -1, dims=0))  # one position off: the engine bug class
    assert not late["ok"] and late["layers"]["aux_low"]["off_share"] > 0.5
    assert check.compare(key, ids[:-1] + [ids[-1] + 1], hs) == {"checked": True, "ids_equal": False, "ok": False}


def test_a_row_speculators_cannot_generate_stops_training(run, tmp_path):
    p = run
    h = p.run_dir / ONLINE_HANDOFF
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}/v1"  # nothing listens: speculators' guard gives the rows up
    with pytest.raises(ValueStageError, match=r"row\(s\) of step 1 were unavailable.*APIConnectionError"):
        train_online(p, h, Path(model_dir(p)), layer_ids_of_store(p.run_dir / "hidden"), tmp_path, CFG, range(4),
                     say=lambda s: None, endpoint=dead,
                     client={"max_retries": 0, "generation_validation_retries": 0})
    lines = [json.loads(x) for x in (tmp_path / "online_states.jsonl").read_text().splitlines()]
    assert lines and not any(x["ok"] for x in lines)


@pytest.mark.slow
def test_online_training_through_a_real_vllm_server_checks_every_echo_and_matches_the_store(run, tmp_path):
    if not (REPO / ".engine" / "bin" / "python").exists():
        pytest.skip(".engine/ absent: run `make engine` (make test builds it)")
    p = run
    h = p.run_dir / ONLINE_HANDOFF
    ids = layer_ids_of_store(p.run_dir / "hidden")
    said: list[str] = []
    tr, info = train_online(p, h, Path(model_dir(p)), ids, tmp_path / "online", CFG, list(range(4)), say=said.append)
    n = len(_keys(h))
    assert n == 4 and tr.steps >= 2
    assert info["server"]["connector"] == "CPUHiddenStatesConnector"
    # every row generated once per epoch, every reply's echoed ids equal to the row's (speculators' extract_output)
    assert info["rows_generated"] == n and info["requests"] == info["echoed_ids_equal"] == n * CFG.epochs
    assert info["failed_requests"] == info["echo_mismatches"] == 0 and info["files_left"] == 0
    # the states it trained on: 04's store for the same key within verify-hidden's recompute tolerance
    st = info["store_check"]
    assert st["rows"] == st["ids_equal"] == n * CFG.epochs and st["failed"] == 0, st
    assert set(st["worst_max_rel"]) == {"aux_low", "aux_mid", "aux_high", "pre_norm", "post_norm"}
    assert any("echoed ids equal" in s for s in said)
    # the same training on the stored states: the same trajectory within the states' bf16 rounding
    ref = train_draft(p.run_dir / "export" / "speculators", Path(model_dir(p)), ids, tmp_path / "exact", CFG,
                      list(range(4)), say=lambda s: None)
    assert tr.steps == ref.steps and tr.train_tokens == ref.train_tokens
    assert [r["loss"] for r in tr.log] == pytest.approx([r["loss"] for r in ref.log], rel=0.02)
    cfg = json.loads((tr.draft_dir / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == ids
