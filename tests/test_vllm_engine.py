"""The real engine: vLLM's CPU build (`make engine`, `.engine/`) started by the tests, never a fake.

(a) 01 with `generate.backend: vllm` and `generate.vllm.launch: true` gives the exact ids of the local
backend on the ci prompts; (b) 04 via vLLM (extract_hidden_states, the project's CPU connector) stores
what 04 via HF stores on the same mix: same keys and order, every aux layer, the pre-norm and the
post-norm state within the HF path's own tolerance (tests/test_hidden.py: one bf16 ulp); both
trainers' loaders read the vLLM store. The hidden-states server is started once for the session.
Skipped, with the reason, only where the engine venv is absent (`make test` builds it first).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from eagle3data.core.params import load_params
from eagle3data.core.records import scan_journal
from eagle3data.generate.backends.vllm_server import VLLMServer, engine_python
from eagle3data.generate.run import run_generate
from eagle3data.hidden.extract import layer_plan, load_config, run_extract
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store import HiddenReader
from eagle3data.hidden.vllm_capture import hidden_command

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "params" / "ci.yaml"
ENGINE = Path(engine_python(load_params(CI, {"generate.backend": "vllm", "generate.vllm.launch": True}).generate.vllm))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not ENGINE.exists(), reason=f"no engine venv ({ENGINE}): run "
                                                                                 "`make engine` (make test does)")]


def ids_by_key(params) -> dict[str, list[int]]:
    out = {}
    for f in sorted((params.run_dir / "records").glob("*.jsonl")):
        for r in scan_journal(f).records:
            out[f"{f.stem}:{r['sample_id']}:{r.get('turn')}"] = (r["prompt_ids"], r["output_ids"])
    return out


def test_01_through_a_launched_vllm_server_gives_the_local_backends_ids(ci_run, tmp_path):
    p = load_params(CI, {"output_root": str(tmp_path), "generate.backend": "vllm", "generate.vllm.launch": True,
                         "generate.vllm.server.port": 0, "generate.concurrency": 4})
    s = run_generate(p, progress=False)
    assert s.status == "finished" and s.new_records == len(ids_by_key(ci_run))
    local, served = ids_by_key(ci_run), ids_by_key(p)
    assert served.keys() == local.keys()
    for k in local:
        assert served[k] == local[k], k  # prompt ids as templated here, output ids as greedy gives them
    log = p.run_dir / "engine" / "vllm_generate.log"
    assert "--enforce-eager" in log.read_text().splitlines()[0]  # the command is the log's first line


@pytest.fixture(scope="session")
def hidden_server(ci_run, tmp_path_factory):
    """One extract_hidden_states server for the session (the project's CPU connector, float32)."""
    files = tmp_path_factory.mktemp("engine_files")
    p = load_params(CI, {"output_root": str(tmp_path_factory.mktemp("srv")), "hidden.backend": "vllm",
                         "hidden.vllm": {"launch": True, "files_dir": str(files), "server": {"port": 0}}})
    with VLLMServer(hidden_command(p, layer_plan(p, load_config(p))), progress=False) as srv:
        yield srv, files


@pytest.fixture(scope="module")
def both_stores(ci_run, hidden_server, tmp_path_factory):
    """04 on the ci mix via HF and via the vLLM server, each into its own store (final_state both)."""
    from eagle3data.core.models import model_for

    srv, _ = hidden_server
    out = {}
    for backend in ("hf", "vllm"):
        root = tmp_path_factory.mktemp(f"store_{backend}")
        shutil.copytree(ci_run.run_dir / "records", root / "ci" / "records")
        over = {"output_root": str(root), "hidden.probe_batches": 0, "hidden.backend": backend,
                "export.draft_vocab_size": 64}
        if backend == "vllm":
            over["hidden.vllm"] = {"base_url": srv.base_url, "concurrency": 4}
        p = load_params(CI, over)
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("WORLD_SIZE", raising=False)
            mp.delenv("RANK", raising=False)
            res = run_extract(p, progress=False, model=model_for(p) if backend == "hf" else None)
        assert res.merged and res.validation.ok, (backend, res.stats)
        out[backend] = (p, res)
    return out


def test_04_via_vllm_stores_what_04_via_hf_stores(both_stores, hidden_server):
    (p_hf, r_hf), (p_vl, r_vl) = both_stores["hf"], both_stores["vllm"]
    hf, vl = HiddenReader(hidden_dir(p_hf)), HiddenReader(hidden_dir(p_vl))
    assert vl.keys() == hf.keys() and len(hf) >= 4  # same samples, same order
    for key in hf.keys():
        a, b = hf.sample(key), vl.sample(key)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        x, y = a["hidden_states"].float(), b["hidden_states"].float()
        assert x.shape == y.shape and x.shape[1] == 5
        for i, name in enumerate(("aux_low", "aux_mid", "aux_high", "pre_norm", "post_norm")):
            torch.testing.assert_close(y[:, i], x[:, i], rtol=2**-7, atol=1e-2, msg=f"{key} {name}")
    assert r_vl.stats["failed"] == 0 and r_vl.stats["backend"] == "vllm"
    _, files = hidden_server
    assert not list(files.iterdir())  # the engine's files were deleted once stored


def test_both_trainers_loaders_read_the_vllm_store(both_stores, tmp_path):
    """SpecForge's and speculators' own loaders read the hand-off of the vLLM store; its post-norm state
    through the model's lm_head predicts the next output token as the model does."""
    from eagle3data.core.models import model_for
    from eagle3data.export.handoff import write_handoff
    from eagle3data.hidden.mix import read_mix
    from specforge.data import preprocessing as specforge_pre
    from speculators.train.data import ArrowDataset

    p, _ = both_stores["vllm"]
    samples = read_mix(hidden_dir(p)).samples
    write_handoff(p, samples, tmp_path / "specforge", "specforge")
    write_handoff(p, samples, tmp_path / "speculators", "speculators")
    ds = specforge_pre.build_offline_eagle3_dataset(str(tmp_path / "specforge" / "features"), max_len=4096)
    arrow = ArrowDataset(max_len=4096, datapath=str(tmp_path / "speculators"), on_missing="raise")
    assert len(ds) == len(arrow) == len(samples)
    model = model_for(p)
    hits = total = 0
    for i, s in enumerate(samples):
        item = ds[i]
        assert item["input_ids"][0].tolist() == s.input_ids and arrow[i]["input_ids"].tolist() == s.input_ids
        with torch.inference_mode():
            pred = model.lm_head(item["target"][0].float())[:-1].argmax(-1)
        pick = torch.tensor(s.loss_mask)[1:].bool()
        hits += int((pred[pick] == torch.tensor(s.input_ids)[1:][pick]).sum())
        total += int(pick.sum())
    assert total > 50 and hits / total >= 0.97, (hits, total)
