"""05's online hand-offs (issue 53), judged by the trainers' own code: speculators 0.9.0's `prepare-data` function
and `ArrowDataset` (and the ids its vLLM client sends), SpecForge 0.2.0's `load_config`, `prepare_prompt_tasks` and
launch plan read every row equal to the mix, in order; the rows they cut or drop are the ones 05 reports; the text
trainers' rule is counted against an independent tokenization."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eagle3data.cli import main as cli
from eagle3data.core.params.export import ONLINE_FORMATS
from eagle3data.core.profiles import get_profile
from eagle3data.export import text_drift
from eagle3data.export.online import window
from eagle3data.export.run import params_of_run, run_export, select_samples

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("speculators")
pytest.importorskip("specforge")


@pytest.fixture
def run_copy(ci_run, tmp_path) -> Path:
    """A private copy of the CI run (01 only: no 04 store, as with `hidden.enabled: false`)."""
    dst = tmp_path / "run"
    shutil.copytree(ci_run.run_dir, dst)
    return dst


def _mix(run_dir: Path):
    return select_samples(params_of_run(run_dir)).samples


def _speculators_rows(folder: Path, max_len: int):
    """What speculators' loader reads and what its vLLM client would send for each row, in order."""
    from speculators.train.data import ArrowDataset, build_client_item

    ds = ArrowDataset(max_len=max_len, datapath=str(folder), on_missing="generate")
    assert ds.transfer.get_cached(0) is None  # no stored state: its loader generates every row online
    return [(build_client_item(ds.data[i])["input_ids"], ds.data[i]["loss_mask"].tolist(), ds.approx_lengths[i])
            for i in range(len(ds))]


def _specforge_rows(folder: Path):
    """SpecForge's config and prompt tasks, loaded as `specforge train` loads them from the folder."""
    from specforge.config import load_config
    from specforge.data.prompt_builder import prepare_prompt_tasks

    cwd = os.getcwd()
    os.chdir(folder)
    try:
        cfg = load_config("specforge.yaml", [])
        tasks = prepare_prompt_tasks(cfg.data.prompts_path, None, chat_template=cfg.data.chat_template,
                                     max_length=cfg.data.max_length, is_preformatted=cfg.data.is_preformatted,
                                     train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=1,
                                     min_loss_tokens=1)  # EAGLE-3's minimum (one_loss_token)
    finally:
        os.chdir(cwd)
    return cfg, [(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks]


def test_cli_writes_both_and_the_peers_read_every_row_equal_to_the_mix(run_copy, capfd, monkeypatch):
    assert not (run_copy / "hidden").exists()  # no 04 store is needed
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # as core.models sets it: datasets' map then warns
    assert cli(["export", str(run_copy), "--format", "speculators_online", "--format", "specforge_online"]) == 0
    printed, err = capfd.readouterr()
    assert "speculators_online: all" in printed and "text-only trainers" in printed
    # the peers' own lines (datasets' "Setting TOKENIZERS_PARALLELISM=false ...") go to the run's log, not the
    # notebook's stderr
    assert "TOKENIZERS_PARALLELISM" not in err + printed
    assert "TOKENIZERS_PARALLELISM" in (run_copy / "export" / "peers.log").read_text(encoding="utf-8")
    mix = _mix(run_copy)
    assert len(mix) == 4
    sp, sf = run_copy / "export" / "speculators_online", run_copy / "export" / "specforge_online"

    ho = json.loads((sp / "handoff.json").read_text())
    assert ho["keys"] == [str(s.key) for s in mix] and ho["rows"] == 4
    assert ho["made_by"].startswith("speculators.data_generation.preprocessing.build_speculator_training_dataset")
    assert not (sp / "hidden_states").exists()
    rows = _speculators_rows(sp, ho["max_length"])
    assert rows == [(s.input_ids, s.loss_mask, len(s.input_ids)) for s in mix]  # bit-equal, in mix order
    n = ho["draft_vocab_size"]
    vocab = np.load(sp / f"d2t-{n}.npy"), np.load(sp / f"t2d-{n}.npy")
    assert vocab[0].dtype == np.int64 and vocab[1].dtype == bool and vocab[1].sum() == n
    # the states server: extract_hidden_states at the plan's layers, served under the name the trainer checks
    srv, layers = ho["states_server"], ho["layers"]
    assert srv["speculative_config"]["method"] == "extract_hidden_states"
    assert srv["layer_ids"] == [*layers["hf_indices"], layers["num_layers"]] == \
        srv["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert srv["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] == srv["shared_storage_path"]
    assert srv["connector"] == "cpu" and srv["env"]["PYTHONPATH"].endswith("vllm_connector")  # ci: model.device cpu
    argv = ho["train_argv"]
    assert argv[argv.index("--verifier-name-or-path") + 1] == srv["served_model_name"] == \
        srv["argv"][srv["argv"].index("--served-model-name") + 1]
    assert argv[argv.index("--vllm-endpoint") + 1] == srv["base_url"]
    assert [int(x) for x in argv[argv.index("--target-layer-ids") + 1:][:3]] == layers["hf_indices"]

    cfg, tasks = _specforge_rows(sf)
    assert cfg.mode == "online" and cfg.deployment.mode == "disaggregated"
    assert tasks == [(s.input_ids, s.loss_mask) for s in mix]
    sho = json.loads((sf / "handoff.json").read_text())
    assert cfg.model.aux_hidden_state_layer_ids == sho["layers"]["layer_outputs"] == sho["capture_server"]["aux_layer_ids"]
    assert cfg.data.max_length == max(len(s.input_ids) for s in mix)
    assert not any(os.path.isabs(v) for v in (cfg.data.prompts_path, cfg.model.vocab_mapping_path))
    man = json.loads((sf / "manifest.json").read_text())
    assert man["format"] == "specforge_online" and man["text_trainers"]["rows"] == 4


def test_capture_server_flags_are_specforges_own(run_copy, tmp_path):
    """The capture command in handoff.json against the plan SpecForge itself makes for the exported config."""
    from specforge.application import resolve_run
    from specforge.config import load_config
    from specforge.launch_plan import build_launch_plan

    assert cli(["export", str(run_copy), "--format", "specforge_online", "--out", str(tmp_path / "sf")]) == 0
    ho = json.loads((tmp_path / "sf" / "handoff.json").read_text())
    cwd = os.getcwd()
    os.chdir(tmp_path / "sf")
    try:
        cfg = load_config("specforge.yaml", [])
        resolved = resolve_run(cfg)
        plan = build_launch_plan(resolved.config, algorithm=resolved.algorithm, config_path="specforge.yaml")
    finally:
        os.chdir(cwd)
    capture = [s for s in plan.services if s.command.label.startswith("capture-server")]
    assert len(capture) == 1
    theirs = list(capture[0].command.argv)
    ours = ho["capture_server"]["argv"]
    for flag in ("--spec-capture-aux-layer-ids", "--spec-capture-method", "--tp-size", "--context-length",
                 "--chunked-prefill-size"):
        i, j = ours.index(flag), theirs.index(flag)
        k = 3 if flag == "--spec-capture-aux-layer-ids" else 1
        assert ours[i + 1:i + 1 + k] == theirs[j + 1:j + 1 + k], flag
    # the model: SpecForge's managed server takes the config's relative `target`; a server started by hand, the folder
    assert ours[ours.index("--model-path") + 1] == ho["specforge_target"]["model_dir"] and "--model-path" in theirs
    for flag in ("--enable-spec-capture", "--skip-tokenizer-init", "--disable-radix-cache"):
        assert flag in theirs and flag in ours


def test_rows_the_trainers_cut_or_drop_are_reported_before_training(run_copy, capsys):
    mix = _mix(run_copy)
    prompt = min(s.loss_mask.index(1) for s in mix)  # the shortest prompt: a window there supervises nothing
    longest = max(s.loss_mask.index(1) for s in mix)
    L = (prompt + longest) // 2 + 1 if prompt != longest else prompt
    p = params_of_run(run_copy)
    p.export.online_max_length = L
    res = run_export(p, formats=list(ONLINE_FORMATS))
    w = window(mix, L)
    assert w["dropped"] and w["rows_out"] < len(mix)  # the case is real: some rows have nothing supervised by L
    sp_ho = res.manifests["speculators_online"]["handoff"]
    assert sp_ho["window"]["dropped"] == w["dropped"] and sp_ho["window"]["truncated"] == w["truncated"]
    kept = [mix[i] for i in w["kept"]]
    want = [(s.input_ids[:L], s.loss_mask[:L]) for s in kept]
    assert [(a, b) for a, b, _ in _speculators_rows(res.out_dir / "speculators_online", L)] == want
    assert _specforge_rows(res.out_dir / "specforge_online")[1] == want  # SpecForge cuts and drops the same rows
    ho = json.loads((res.out_dir / "speculators_online" / "handoff.json").read_text())
    assert ho["keys"] == [str(s.key) for s in kept]
    proc = subprocess.run([sys.executable, "bench/check_handoff.py", str(run_copy)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["speculators_online"]["equal_to_mix"] and report["specforge_online"]["equal_to_mix"]
    assert cli(["export", str(run_copy), "--format", "specforge_online"]) == 0  # the run's own params: whole rows
    assert "all 4 rows go to the trainer whole" in capsys.readouterr().out


def test_text_trainers_rule_is_counted_against_the_templates_own_tokenization(run_copy):
    from eagle3data.core.models import tokenizer_for

    p = params_of_run(run_copy)
    mix, tok = _mix(run_copy), tokenizer_for(p)
    prof = get_profile(p.profile)
    d = text_drift.text_drift(mix, tok, prof)
    # Model-Optimizer's form of the rule: apply_chat_template(tokenize=True), computed independently here
    same = 0
    for s in mix:
        rec = s.record
        msgs = [*rec["messages"], {"role": "assistant", "content": rec.get("content") or ""}]
        theirs = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False, **prof.template_kwargs))
        ours = s.input_ids
        same += theirs == ours or (theirs[:len(ours)] == ours and ours[-1] in prof.stop_ids)
    assert d["rows"] == len(mix) and d["reproduced"] == same
    assert d["reproduced"] + d["differ"] == len(mix) and sum(d["differ_kinds"].values()) == d["differ"]
    # a row whose ids are not what the text gives is named, with where it differs
    s0 = mix[0]
    bad = type(s0)(**{**s0.__dict__, "input_ids": [*s0.input_ids[:3], 0, *s0.input_ids[4:]]})
    d2 = text_drift.text_drift([bad], tok, prof)
    assert d2["differ"] == 1 and d2["differing_keys"] == [str(s0.key)]
    assert d2["first_differing"][0]["position"] == 3 and d2["first_differing"][0]["kind"] == "inside"


def test_bad_input_is_one_line_and_exit_2(run_copy, tmp_path):
    bad = subprocess.run([sys.executable, "-m", "eagle3data", "export", str(tmp_path / "nowhere"), "--format",
                          "speculators_online"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no such run folder" in bad.stderr
    nope = subprocess.run([sys.executable, "-m", "eagle3data", "export", str(run_copy), "--format", "online"],
                          capture_output=True, text=True, cwd=REPO)
    assert nope.returncode == 2 and "invalid choice" in nope.stderr
    from eagle3data.core.params import load_params

    with pytest.raises(Exception, match="unknown trainer 'speculators_offline'"):
        load_params(REPO / "params" / "ci.yaml", {"export.formats": ["speculators_offline"]})
    assert load_params(REPO / "params" / "ci.yaml", {"export.formats": list(ONLINE_FORMATS),
                                                      "hidden.enabled": False}).export.formats == list(ONLINE_FORMATS)
