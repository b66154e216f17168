"""The real SGLang engine (`make sglang`: `.sglang/`, sglang 0.5.23 on the CPU with the stand-in kernels of
engines/sglang_cpu_stub) started by the tests, never a fake.

(a) 01 with `generate.backend: sglang` and `generate.sglang.launch: true` gives the local backend's exact ids for
every key of the ci run (greedy), finish reasons and usage read from the real `meta_info`; (b) the loopback SGLang
server the fault tests use (tests/loopback.py) answers what the real one answers, field by field: the shapes of a
reply, a batch, `meta_info`, `finish_reason` (stop, length) and the errors on bad input; (c) 04 with `hidden.backend:
sglang` (two launched servers in turn: aux, then final; radix cache off) stores what 04 via HF stores, within bf16
per sample and state, passes `verify-hidden` with its picked samples recomputed through SGLang (04's own verify: the
two servers launched again in turn), `verify-hidden --recompute all` catches a fault only the recompute sees, and
SpecForge's loader reads its export; (d) no stand-in kernel is
called: every server log of this module shows the stand-in loaded in its processes and never called.
One server at a time (each takes ~4.5 GB). Skipped, with the reason, only where the SGLang venv is absent (`make test`
builds it first).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import orjson
import pytest
import torch

from eagle3data.core.params import load_params
from eagle3data.core.records import scan_journal
from eagle3data.generate.backends.retries import error_message
from eagle3data.generate.backends.sglang_server import SGLangServer, sglang_command, sglang_python
from eagle3data.generate.run import run_generate
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.verify.command import verify_cli
from loopback import LoopbackServer

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "params" / "ci.yaml"
SGLANG = Path(sglang_python(load_params(CI, {"generate.backend": "sglang",
                                             "generate.sglang.launch": True}).generate.sglang))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not SGLANG.exists(), reason=f"no SGLang venv ({SGLANG}): run "
                                                                                 "`make sglang` (make test does)")]
LOGS: list[Path] = []  # every server log of this module, for (d)
RUNNING: list[SGLangServer] = []  # module-scoped servers, stopped before a test launches its own (one at a time)


def records_by_key(params) -> dict[str, dict]:
    out = {}
    for f in sorted((params.run_dir / "records").glob("*.jsonl")):
        for r in scan_journal(f).records:
            out[f"{f.stem}:{r['sample_id']}:{r.get('turn')}"] = r
    return out


# ---------------------------------------------------------------------------- (a) 01


def test_01_through_a_launched_sglang_server_gives_the_local_backends_ids(ci_run, tmp_path):
    p = load_params(CI, {"output_root": str(tmp_path), "generate.backend": "sglang", "generate.concurrency": 4,
                         "generate.sglang": {"launch": True, "server": {"port": 0}}})
    s = run_generate(p, progress=False)
    log = p.run_dir / "engine" / "sglang_generate.log"
    LOGS.append(log)
    local, served = records_by_key(ci_run), records_by_key(p)
    assert s.status == "finished" and served.keys() == local.keys() and s.new_records == len(local)
    n_max = p.generate.sampling.max_new_tokens
    for k, want in local.items():
        got = served[k]
        assert got["prompt_ids"] == want["prompt_ids"] and got["output_ids"] == want["output_ids"], k  # greedy, exact
        assert got["source"] == "sglang" and got["ids_exact"] and got["error"] is None
        out = got["output_ids"]
        if got["finish_reason"] == "stop":  # meta_info.finish_reason {"type": "stop", "matched": <the stop id>}
            assert got["native_finish_reason"] == f"stop:{out[-1]}" and out[-1] in (2,), k
        else:  # {"type": "length", "length": max_new_tokens}
            assert got["finish_reason"] == "length" and got["native_finish_reason"] == f"length:{n_max}"
            assert len(out) == n_max, k
        u = got["usage"]  # meta_info's counts, as the server gave them
        assert (u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"]) == (len(got["prompt_ids"]), len(out),
                                                                                    u["cached_tokens"])
        assert isinstance(u["cached_tokens"], int) and len(got["generation_id"]) == 32
    first = log.read_text().splitlines()[0]  # the command is the log's first line
    assert "SGLANG_USE_CPU_ENGINE=1" in first and "--attention-backend torch_native" in first


# ---------------------------------------------------------------------------- (b) the loopback against the real one


def shape(x):
    """The JSON shape of a value: dicts by key, lists by their first item, scalars by type name."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shape(x[0])] if x else []
    return type(x).__name__


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    p = load_params(CI, {"output_root": str(tmp_path_factory.mktemp("sglang_plain")), "generate.backend": "sglang",
                         "generate.sglang": {"launch": True, "server": {"port": 0, "radix_cache": False}}})
    with SGLangServer(sglang_command(p, p.generate.sglang, stage="probe"), progress=False) as srv:
        LOGS.append(srv.cmd.log)
        RUNNING.append(srv)
        yield srv


PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2]
SP = {"max_new_tokens": 6, "temperature": 0.0, "skip_special_tokens": False, "no_stop_trim": True,
      "stop_token_ids": [2]}
PROBES = {  # name -> request body (bytes: sent as they are)
    "one": {"input_ids": PROMPT, "sampling_params": SP},
    "batch": {"input_ids": [PROMPT, PROMPT[:5]], "sampling_params": SP},
    "length": {"input_ids": PROMPT, "sampling_params": {**SP, "max_new_tokens": 2}},
    "empty": {"input_ids": [], "sampling_params": SP},
    "no_input": {"sampling_params": SP},
    "too_long": {"input_ids": [5] * 9000, "sampling_params": SP},
    "over_context": {"input_ids": [5] * 8190, "sampling_params": SP},
    "not_json": b"{not json",
}
# what the client reads of meta_info (generate/backends/sglang.py): the loopback must give each, typed as the real one
READ = ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency")


def test_the_loopback_sglang_server_answers_as_the_real_one(plain_server):
    """Each probe goes to the real server (radix cache off), then to the loopback scripted with the real output ids:
    same status; an error body of the same shape with the same message; a reply (one, a batch) of the same shape with
    every loopback `meta_info` field typed as the real one's, and the same ids, finish reason and counts."""
    real_out: dict[tuple, list[int]] = {}
    seen = set()
    with LoopbackServer("sglang", context_len=8192) as fake:
        fake.script = lambda p: real_out[tuple(p)]
        for name, body in PROBES.items():
            got = {}
            for who, url in (("real", plain_server.base_url), ("loopback", fake.base_url)):
                content = body if isinstance(body, bytes) else orjson.dumps(body)
                r = httpx.post(url + "/generate", content=content, headers={"content-type": "application/json"},
                               timeout=600)
                got[who] = (r.status_code, orjson.loads(r.content))
                if who == "real" and r.status_code == 200:
                    prompts = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
                    answers = got["real"][1] if isinstance(got["real"][1], list) else [got["real"][1]]
                    real_out.update({tuple(p): a["output_ids"] for p, a in zip(prompts, answers)})
            (rs, real), (fs, fake_body) = got["real"], got["loopback"]
            assert rs == fs, (name, rs, fs, real, fake_body)
            seen.add(name)
            if rs != 200:  # the same error body shape, and the message the client shows
                assert shape(fake_body) == shape(real), (name, real, fake_body)
                if name != "not_json":  # the real one names a file of its own install there
                    assert error_message(orjson.dumps(fake_body)) == error_message(orjson.dumps(real)), name
                continue
            for a, b in zip(*(x if isinstance(x, list) else [x] for x in (real, fake_body))):
                assert isinstance(real, list) == isinstance(fake_body, list), name
                assert set(a) == set(b) == {"text", "output_ids", "meta_info"}, name
                assert shape(a["output_ids"]) == shape(b["output_ids"]) == ["int"]
                ma, mb = a["meta_info"], b["meta_info"]
                assert set(READ) <= set(ma) and set(READ) <= set(mb), name
                assert {k: shape(ma[k]) for k in mb} == shape(mb), (name, ma, mb)  # every loopback field as real
                assert a["output_ids"] == b["output_ids"] and ma["finish_reason"] == mb["finish_reason"], (name, a, b)
                for k in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                    assert ma[k] == mb[k], (name, k, ma, mb)
    assert seen == set(PROBES)


# ---------------------------------------------------------------------------- (c) 04 via SGLang


@pytest.fixture(scope="module")
def both_stores(ci_run, tmp_path_factory):
    """04 on the ci mix via HF and via SGLang (two launched servers in turn), post-norm final state both."""
    from eagle3data.core.models import model_for
    from eagle3data.hidden.extract import run_extract

    for srv in RUNNING:  # one server at a time
        srv.stop()
    out = {}
    for backend in ("hf", "sglang"):
        root = tmp_path_factory.mktemp(f"store_{backend}")
        shutil.copytree(ci_run.run_dir / "records", root / "ci" / "records")
        over = {"output_root": str(root), "hidden.probe_batches": 0, "hidden.backend": backend,
                "hidden.final_state": "post_norm", "hidden.storage": "bf16",  # the engine's states as captured
                "export.draft_vocab_size": 64}
        if backend == "sglang":
            over["hidden.sglang"] = {"launch": True, "concurrency": 4, "server": {"port": 0}}
        p = load_params(CI, over)
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("WORLD_SIZE", raising=False)
            mp.delenv("RANK", raising=False)
            res = run_extract(p, progress=False, model=model_for(p) if backend == "hf" else None)
        assert res.merged and res.validation.ok, (backend, res.stats)
        out[backend] = (p, res)
    LOGS.extend(sorted((out["sglang"][0].run_dir / "engine").glob("sglang_*.log")))  # the capture's and the verify's
    return out


def test_04_via_sglang_stores_what_04_via_hf_stores(both_stores):
    (p_hf, _), (p_sg, r_sg) = both_stores["hf"], both_stores["sglang"]
    hf, sg = HiddenReader(hidden_dir(p_hf)), HiddenReader(hidden_dir(p_sg))
    assert sg.keys() == hf.keys() and len(hf) >= 4  # same samples, same order
    for key in hf.keys():
        a, b = hf.sample(key), sg.sample(key)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        x, y = a["hidden_states"].float(), b["hidden_states"].float()
        assert x.shape == y.shape and x.shape[1] == 4
        for i, name in enumerate(("aux_low", "aux_mid", "aux_high", "post_norm")):
            torch.testing.assert_close(y[:, i], x[:, i], rtol=2**-7, atol=1e-2, msg=f"{key} {name}")
    st = r_sg.stats
    assert st["failed"] == 0 and st["backend"] == "sglang" and st["staged_aux"] == 0  # staging emptied once stored
    assert not list((hidden_dir(p_sg) / "sglang_aux").glob("*.safetensors"))
    aux_log = (p_sg.run_dir / "engine" / "sglang_hidden_aux.log").read_text().splitlines()[0]
    assert "--return-aux-hidden-state-layer-ids 1 14 26" in aux_log and "--disable-radix-cache" in aux_log


def test_04s_own_verify_recomputes_the_sglang_store_through_sglang(both_stores):
    """04's verify pass (hidden.verify_after) recomputes its picked samples through SGLang itself: its own two launched
    servers (the capture's commands, logs sglang_verify_*), every stored layer within the store's tolerance."""
    p, r = both_stores["sglang"]
    v = r.verification
    s = v.summary
    assert v.ok and s["recomputed"] >= 1 and s["checks"]["recompute"] == {**s["checks"]["recompute"], "failed": 0,
                                                                         "applicable": s["recomputed"]}, s["checks"]
    layers = [x for row in v.rows if "recompute" in row for x in row["recompute"].values()]
    assert len(layers) == 4 * s["recomputed"] and not any(x["off_share"] or x["gross"] for x in layers), layers
    logs = p.run_dir / "engine"
    aux = (logs / "sglang_verify_aux.log").read_text().splitlines()[0]
    final = (logs / "sglang_verify_final.log").read_text().splitlines()[0]
    assert "--return-aux-hidden-state-layer-ids 1 14 26" in aux and "--disable-radix-cache" in aux
    assert final.endswith("--enable-return-hidden-states") and "--disable-radix-cache" in final
    assert not list(hidden_dir(p).glob("sglang_verify_*"))  # the recompute's scratch is gone


def test_verify_hidden_passes_on_the_sglang_store(both_stores, tmp_path):
    p, _ = both_stores["sglang"]
    assert verify_cli(str(p.run_dir), recompute="0", positions=0, out=str(tmp_path / "v.jsonl")) == 0
    rows = [orjson.loads(x) for x in (tmp_path / "v.jsonl").read_bytes().splitlines()]
    assert rows and not any(r["failed"] for r in rows)


def test_verify_hidden_recomputes_through_sglang_and_catches_what_only_the_recompute_sees(both_stores, tmp_path):
    """`verify-hidden --recompute all` on a copy of the SGLang store (the run's params: launched servers, one at a
    time) whose first sample has its aux_mid rows one position off (an engine's off-by-one in one layer: the same
    rows' norms, the same profile, a layer the head never reads): every sample is recomputed through SGLang, that
    sample fails `recompute`, no other does, and the exit status is 1."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from eagle3data.core.provenance import params_of_run
    from runfiles import as_written

    p, _ = both_stores["sglang"]
    run = tmp_path / p.run_name
    shutil.copytree(p.run_dir, run)
    hdir = hidden_dir(params_of_run(run))
    rd = HiddenReader(hdir)
    assert rd.layout == "shards"
    key, row = rd.keys()[0], rd.index.iloc[0]
    shard, a, n = row["shard"], int(row["offset"]), int(row["length"])
    t = load_file(str(hdir / shard))
    with safe_open(str(hdir / shard), framework="pt") as f:
        meta = f.metadata()
    t["hidden_states"][a:a + n, 1] = torch.roll(t["hidden_states"][a:a + n, 1].clone(), 1, dims=0)
    save_file(t, str(hdir / shard), metadata=meta)
    as_written(hdir, shard)  # the fault as the engine would have written it: only the checks under test see it
    assert verify_cli(str(run), recompute="all", positions=0, out=str(tmp_path / "v.jsonl")) == 1
    LOGS.extend(sorted((run / "engine").glob("sglang_verify_*.log")))
    rows = {r["key"]: r for r in (orjson.loads(x) for x in (tmp_path / "v.jsonl").read_bytes().splitlines())}
    assert len(rows) == len(rd) >= 4 and all("recompute" in r for r in rows.values())
    assert "recompute" in rows[key]["failed"], rows[key]
    assert rows[key]["recompute"]["aux_mid"]["off_share"] > 0.5, rows[key]["recompute"]
    assert not [k for k, r in rows.items() if k != key and "recompute" in r["failed"]]
    s = orjson.loads((hdir / "verify_summary.json").read_bytes())
    assert s["recomputed"] == len(rows) and s["checks"]["recompute"]["failed"] == 1


def test_specforges_loader_reads_the_sglang_store(both_stores, tmp_path):
    """SpecForge's own loader reads the hand-off of the SGLang store (its post-norm final state is what SpecForge
    trains on); through the model's lm_head it predicts the next output token as the model does. speculators' hand-off,
    which needs the pre-norm state SGLang cannot return, is refused in one line naming it."""
    from eagle3data.core.models import model_for
    from eagle3data.export.handoff import write_handoff
    from eagle3data.hidden.mix import read_mix
    from specforge.data import preprocessing as specforge_pre

    p, _ = both_stores["sglang"]
    samples = read_mix(hidden_dir(p)).samples
    with pytest.raises(Exception, match="pre_norm") as refused:
        write_handoff(p, samples, tmp_path / "speculators", "speculators")
    assert "\n" not in str(refused.value)
    write_handoff(p, samples, tmp_path / "specforge", "specforge")
    ds = specforge_pre.build_offline_eagle3_dataset(str(tmp_path / "specforge" / "features"), max_len=4096)
    assert len(ds) == len(samples)
    model = model_for(p)
    hits = total = 0
    for i, s in enumerate(samples):
        item = ds[i]
        assert item["input_ids"][0].tolist() == s.input_ids
        with torch.inference_mode():
            pred = model.lm_head(item["target"][0].float())[:-1].argmax(-1)
        pick = torch.tensor(s.loss_mask)[1:].bool()
        hits += int((pred[pick] == torch.tensor(s.input_ids)[1:][pick]).sum())
        total += int(pick.sum())
    assert total > 50 and hits / total >= 0.97, (hits, total)


# ---------------------------------------------------------------------------- (d) the stand-in kernels


def test_no_stand_in_kernel_was_called():
    """Every SGLang server this module started loaded the stand-in sgl_kernel in each of its processes and called
    none of its functions (each would have printed STANDIN_CALLED and raised)."""
    import subprocess

    assert len(LOGS) >= 4, LOGS  # 01's server, the plain one, the aux and the final pass of 04
    for log in LOGS:
        text = log.read_text(errors="replace")
        assert text.count("STANDIN_LOADED") >= 3, log  # API server, scheduler, detokenizer
        assert "STANDIN_CALLED" not in text, log
    probe = subprocess.run([str(SGLANG), "-c", "import sgl_kernel as k; k.copy_all_layer_kv_cache_cpu()"],
                           capture_output=True, text=True)  # the tripwire fires when called
    assert probe.returncode != 0 and "StandInCalled" in probe.stderr and "STANDIN_CALLED" in probe.stderr
