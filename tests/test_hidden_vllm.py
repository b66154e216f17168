"""04's `vllm` backend against the vLLM-shaped loopback server (tests/loopback.py) that writes hidden-states
files as vLLM's connector does: what is stored, the fault cases (a lost file, a lock never released, a
wrong echoed id, a dead server: each fails its samples with the reason and loses nothing else), Ctrl-C
and resume, 04's own verify and `verify-hidden` recomputing through the server, the final norm's kind,
the params and the server command; a launched server's lifetime (a process standing in for vLLM):
it dies with its launcher, and a stale one is stopped by the next start. The real engine:
tests/test_vllm_engine.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import psutil
import pytest
import torch

from eagle3data.core.params import ParamsError, load_params
from eagle3data.generate.backends.vllm_server import (EngineCommand, ServerError, VLLMServer, free_port, model_dir,
                                                       server_command)
from eagle3data.hidden.capture import layer_plan, load_config
from eagle3data.hidden.extract import run_extract
from eagle3data.hidden.mix import hidden_dir, read_mix
from eagle3data.hidden.store.format import read_shard_meta, shard_dir
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.store.format import HiddenError
from eagle3data.hidden.store.failures import SamplesFailed
from eagle3data.hidden.verify.command import verify_cli
from eagle3data.hidden.norms import rms_norm
from eagle3data.hidden.engines.vllm_capture import final_norm, hidden_command, norm_kind

sys.path.insert(0, str(Path(__file__).parent))
from loopback import LoopbackServer  # noqa: E402
from runfiles import as_written  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
H = 576


def fake_states(ids: list[int]) -> torch.Tensor:
    """What the fake engine returns for a sequence: [n, 4, H], a function of the ids and positions."""
    t = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    k = torch.arange(4, dtype=torch.float32)[None, :, None]
    j = torch.arange(H, dtype=torch.float32)[None, None, :]
    pos = torch.arange(len(ids), dtype=torch.float32)[:, None, None]
    return torch.sin(t * 0.013 + k * 1.7 + j * 0.05 + pos * 0.11) * (1 + k)


@pytest.fixture
def fake_engine(tmp_path):
    files = tmp_path / "engine_files"
    files.mkdir()
    srv = LoopbackServer("vllm", model_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    srv.hidden_states, srv.hidden_dir = fake_states, files
    with srv:
        yield srv
    for fd in srv.held_locks:
        os.close(fd)


@pytest.fixture
def vllm_params(ci_run, tmp_path):
    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")

    def make(srv: LoopbackServer, **over):
        base = {"output_root": str(tmp_path), "hidden.probe_batches": 0, "hidden.backend": "vllm",
                "hidden.vllm": {"base_url": srv.base_url, "concurrency": 4, "lock_timeout_s": 0.5,
                                "max_retries": 0, "timeout_s": 5}, "generate.stop_grace_s": 5,
                "hidden.storage": "bf16"}  # the engine's files are compared with the store value for value
        return load_params(REPO / "params" / "ci.yaml", {**base, **over})

    return make


def stored_keys(p) -> list[str]:
    return [e["key"] for f in shard_dir(hidden_dir(p)).glob("*.safetensors") for e in read_shard_meta(f)["samples"]]


def completions(srv: LoopbackServer) -> list[dict]:
    return [r for r in srv.requests if r["path"] == "/completions"]


def test_the_store_holds_what_the_engine_wrote(fake_engine, vllm_params, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = vllm_params(fake_engine)
    res = run_extract(p, progress=False)
    assert res.merged and res.validation.ok, res.validation.table()
    mix = read_mix(hidden_dir(p))
    rd = HiddenReader(hidden_dir(p))
    assert rd.keys() == [str(s.key) for s in mix.samples]  # the HF path's keys and order: the mix's
    config = load_config(p)
    weight, eps = final_norm(p, config)
    for s in mix.samples:
        got = rd.sample(s.key)["hidden_states"]
        want = fake_states(s.input_ids)
        assert got.shape == (len(s.input_ids), 5, H) and got.dtype == torch.bfloat16
        assert torch.equal(got[:, :4], want.to(torch.bfloat16))  # aux x 3 and pre-norm as the engine wrote them
        assert torch.equal(got[:, 4], rms_norm(want[:, 3], weight, eps).to(torch.bfloat16))
    sent = completions(fake_engine)
    n = len(mix.samples)
    assert sorted(tuple(r["body"]["prompt"]) for r in sent[:n]) == sorted(tuple(s.input_ids) for s in mix.samples)
    assert all(r["body"]["max_tokens"] == 1 and r["body"]["return_token_ids"] is True for r in sent)
    # 04's own verify recomputed its verify_recompute samples through the same server, and they agree
    v = res.verification.summary
    assert v["recomputed"] == len(sent) - n == min(p.hidden.verify_recompute, n) > 0
    assert v["checks"]["recompute"] == {**v["checks"]["recompute"], "applicable": v["recomputed"], "failed": 0}
    assert not list(fake_engine.hidden_dir.iterdir())  # every engine file (and lock) deleted once stored
    assert res.stats["backend"] == "vllm" and res.stats["failed"] == 0 and res.stats["extracted"] == len(mix.samples)


def test_post_norm_is_the_models_own_final_norm(ci_run):
    from eagle3data.core.models import model_for

    model = model_for(ci_run)
    weight, eps = final_norm(ci_run, model.config)
    x = torch.randn(7, H) * 30
    with torch.inference_mode():
        assert torch.allclose(rms_norm(x, weight, eps), model.model.norm(x), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fault, reason", [
    ("hs_lost", r"not ready after 0.5 s \(no file and no lock"),
    ("hs_locked", r"not ready after 0.5 s \(still locked"),
    ("prompt_changed", r"echoed prompt_token_ids \(\d+ ids\) differ from the \d+ ids sent"),
])
def test_a_bad_reply_fails_its_sample_alone_and_resume_completes_it(fake_engine, vllm_params, monkeypatch,
                                                                    fault, reason):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = vllm_params(fake_engine)
    fake_engine.faults.append(fault)
    with pytest.raises(SamplesFailed, match=r"^1 of \d+ samples failed after their retries") as failed:
        run_extract(p, progress=False)  # a sample the engine failed is a failed stage (issue 52): nothing merged
    res = failed.value.result
    n = len(read_mix(hidden_dir(p)).samples)
    assert not res.merged and res.stats["failed"] == 1 and "\n" not in str(failed.value)
    (f,) = res.stats["failures"]
    assert re.search(reason, f["error"]), f["error"]
    assert len(stored_keys(p)) == n - 1 and f["key"] not in stored_keys(p)  # nothing else lost
    ledger = orjson.loads((hidden_dir(p) / "vllm_ledger.json").read_bytes())
    assert [x["key"] for x in ledger["failures"]] == [f["key"]]
    again = run_extract(p, progress=False)
    assert again.merged and again.validation.ok and again.stats["extracted"] == 1
    keys = stored_keys(p)
    assert len(keys) == len(set(keys)) == n  # no sample twice


def test_a_dead_server_fails_the_rest_keeps_what_was_stored(fake_engine, vllm_params, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = vllm_params(fake_engine, **{"hidden.vllm.concurrency": 1})
    fake_engine.faults.extend(["none", "die"])
    with pytest.raises(SamplesFailed) as failed:
        run_extract(p, progress=False)
    res = failed.value.result
    n = len(read_mix(hidden_dir(p)).samples)
    assert res.stats["extracted"] == 1 and res.stats["failed"] == n - 1 and not res.merged
    assert all("ConnectError" in f["error"] or "closed" in f["error"] for f in res.stats["failures"]), \
        res.stats["failures"]
    assert len(stored_keys(p)) == 1
    with LoopbackServer("vllm") as srv2:  # the server is back (elsewhere): resume completes
        srv2.hidden_states, srv2.hidden_dir = fake_states, fake_engine.hidden_dir
        again = run_extract(vllm_params(srv2, **{"hidden.vllm.concurrency": 1}), progress=False)
    assert again.merged and again.validation.ok and again.stats["extracted"] == n - 1
    keys = stored_keys(p)
    assert len(keys) == len(set(keys)) == n


def test_ctrl_c_keeps_the_shard_in_progress_and_resume_stores_each_sample_once(fake_engine, vllm_params,
                                                                               monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    fake_engine.latency = 0.4
    p = vllm_params(fake_engine, **{"hidden.vllm.concurrency": 1})
    timer = threading.Timer(0.9, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        res = run_extract(p, progress=False)
    finally:
        timer.cancel()
    n = len(read_mix(hidden_dir(p)).samples)
    assert res.stats["stopped_early"] and "SIGINT" in res.stats["stop_reason"] and not res.merged
    kept = stored_keys(p)
    assert 1 <= len(kept) < n and res.stats["extracted"] == len(kept)  # what came back before the stop is on disk
    fake_engine.latency = 0.0
    again = run_extract(p, progress=False)
    assert again.merged and again.validation.ok and again.stats["already_stored"] == len(kept)
    keys = stored_keys(p)
    assert len(keys) == len(set(keys)) == n


def test_hidden_backend_params_are_strict(ci_run):
    ci = REPO / "params" / "ci.yaml"
    assert load_params(ci).hidden.backend == "hf"
    with pytest.raises(ParamsError, match=r"backend 'vllm' needs a `hidden.vllm` section"):
        load_params(ci, {"hidden.backend": "vllm"})
    with pytest.raises(ParamsError, match=r"needs `base_url` \(a running one\) or `launch: true`"):
        load_params(ci, {"hidden.backend": "vllm", "hidden.vllm": {}})
    with pytest.raises(ParamsError, match=r"unknown key `hidden.vllm.nope`"):
        load_params(ci, {"hidden.backend": "vllm", "hidden.vllm.launch": "true", "hidden.vllm.nope": 1})
    with pytest.raises(ParamsError, match=r"hidden.backend"):
        load_params(ci, {"hidden.backend": "sglang"})
    p = load_params(ci, {"hidden.backend": "vllm", "hidden.vllm.launch": "true"})
    assert p.hidden.vllm.launch and p.hidden.vllm.base_url is None


def test_the_launched_command_for_the_embedded_model(ci_run, tmp_path):
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "hidden.backend": "vllm",
                                                   "hidden.vllm.launch": "true", "hidden.vllm.server.port": 8123})
    cmd = hidden_command(p, layer_plan(p, load_config(p)))
    argv = cmd.argv
    assert argv[0] == str(REPO / ".engine" / "bin" / "python") and argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert Path(flag["--model"]).is_dir() and flag["--served-model-name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert flag["--dtype"] == "float32" and flag["--port"] == "8123" and flag["--tensor-parallel-size"] == "1"
    assert "--enforce-eager" in argv and flag["--max-model-len"] == "8192"
    spec, kv = orjson.loads(flag["--speculative-config"]), orjson.loads(flag["--kv-transfer-config"])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    assert kv["kv_connector"] == "CPUHiddenStatesConnector" and kv["kv_connector_module_path"] == "cpu_hidden_states"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(hidden_dir(p) / "engine_files")
    assert cmd.env == {"VLLM_CPU_KVCACHE_SPACE": "2"} and cmd.base_url == "http://127.0.0.1:8123/v1"
    connector = Path(cmd.extra_env_path[0]) / "cpu_hidden_states.py"
    assert connector.is_file() and "class CPUHiddenStatesConnector" in connector.read_text()
    line = cmd.shell()
    assert line.startswith("VLLM_CPU_KVCACHE_SPACE=2 PYTHONPATH=") and shlex.split(line)[2:] == argv
    gen = server_command(p, p.hidden.vllm, stage="generate")
    assert "--speculative-config" not in gen.argv and "--kv-transfer-config" not in gen.argv


def test_kimi_vllm_params_and_the_command_to_start_its_server(capsys):
    from eagle3data.cli import main

    p = load_params(REPO / "params" / "kimi_vllm.yaml")
    v = p.hidden.vllm
    assert p.hidden.backend == "vllm" and not v.launch and v.base_url.endswith("/v1")
    assert v.server.tensor_parallel_size == 8 and p.model.name == v.model == "moonshotai/Kimi-K2.5"
    assert main(["extract", str(REPO / "params" / "kimi_vllm.yaml"), "--print-engine-command"]) == 0
    out = capsys.readouterr().out.strip()
    argv = shlex.split(out)
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flag["--tensor-parallel-size"] == "8" and flag["--model"] == "/models/Kimi-K2.5"
    assert "--trust-remote-code" in argv and "--enforce-eager" not in argv and flag["--dtype"] == "bfloat16"
    ids = orjson.loads(flag["--speculative-config"])["draft_model_config"]["hf_config"]
    assert ids["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58, 61]
    kv = orjson.loads(flag["--kv-transfer-config"])
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in kv
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == v.files_dir
    assert "PYTHONPATH" not in out and "VLLM_CPU_KVCACHE_SPACE" not in out


def _scale_one_sample(p, key: str, layer: int, factor: float) -> None:
    """Multiply one stored sample's layer by `factor` in its shard on disk (a change no statistic sees)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    rd = HiddenReader(hidden_dir(p))
    row = rd.index.iloc[rd.keys().index(key)]
    f = hidden_dir(p) / row["shard"]
    with safe_open(str(f), framework="pt") as h:
        meta = h.metadata()
    t = load_file(str(f))
    a, n = int(row["offset"]), int(row["length"])
    t["hidden_states"][a:a + n, layer] = (t["hidden_states"][a:a + n, layer].float() * factor).to(torch.bfloat16)
    save_file(t, str(f), metadata=meta)
    as_written(hidden_dir(p), f)  # as the engine wrote it (the recompute is under test, not the checksum)


def test_verify_hidden_recomputes_a_vllm_store_through_the_server(fake_engine, vllm_params, monkeypatch):
    """`verify-hidden --recompute all` on a vLLM store sends each sample to the run's vLLM server (the
    backend that made it) and flags the one sample whose stored layer differs from the engine's."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = vllm_params(fake_engine, **{"hidden.verify_after": False})
    assert run_extract(p, progress=False).merged
    keys = HiddenReader(hidden_dir(p)).keys()
    before = len(completions(fake_engine))
    _scale_one_sample(p, keys[1], layer=1, factor=1.02)  # aux_mid of one sample, 2% off
    verify_cli(str(p.run_dir), recompute="all", positions=64, out=None)
    rows = [orjson.loads(x) for x in (hidden_dir(p) / "verify.jsonl").read_bytes().splitlines()]
    assert len(completions(fake_engine)) - before == len(keys)  # every sample recomputed by the server
    assert [r["key"] for r in rows if "recompute" in r["failed"]] == [keys[1]]
    assert not list(fake_engine.hidden_dir.iterdir())  # the recompute's engine files deleted too


def test_the_final_norm_kind_is_the_models_own():
    """NORM_KINDS against transformers' own norm classes: `rms_norm` with `final_norm`'s multiplier (`w` or
    `1 + w`) equals each class's forward; a model type whose norm is unknown or not an RMSNorm is refused."""
    import importlib

    from transformers import AutoConfig

    cases = {"llama": "LlamaRMSNorm", "qwen3": "Qwen3RMSNorm", "deepseek_v3": "DeepseekV3RMSNorm",
             "gemma": "GemmaRMSNorm", "gemma3_text": "Gemma3RMSNorm", "qwen3_next": "Qwen3NextRMSNorm"}
    x = torch.randn(5, 16) * 7
    for mt, cls in cases.items():
        module = mt.removesuffix("_text")
        norm = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)(16, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(16) * 0.3)
            want = norm(x)
        w = norm.weight.detach().float()
        got = rms_norm(x, 1.0 + w if norm_kind(AutoConfig.for_model(mt)) == "rms_1p" else w, 1e-6)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), mt
    for mt in ("gpt_neox", "phi", "olmo"):  # LayerNorm finals (or none known): refused, in one line
        with pytest.raises(HiddenError, match=rf"model_type '{mt}': the kind of its final norm is not known"):
            norm_kind(AutoConfig.for_model(mt))
    # the eps: the one norm reader's rule (`norms.norm_eps`, verify's head too): rms_norm_eps, else layer_norm_epsilon
    from types import SimpleNamespace

    cfg = SimpleNamespace(model_type="llama", hidden_size=16)
    with pytest.raises(HiddenError, match="the config has no rms_norm_eps"):
        norm_kind(cfg)
    cfg.layer_norm_epsilon = 1e-5
    assert norm_kind(cfg) == "rms"


def test_a_checkpoint_without_the_final_norm_is_refused(ci_run, tmp_path):
    from safetensors.torch import save_file

    src = model_dir(ci_run)
    shutil.copy(Path(src) / "config.json", tmp_path / "config.json")
    save_file({"model.embed_tokens.weight": torch.zeros(4, H)}, str(tmp_path / "model.safetensors"))
    p = load_params(REPO / "params" / "ci.yaml", {"model.path": str(tmp_path)})
    with pytest.raises(HiddenError, match=r"no `model.norm.weight` in the checkpoint.*hidden.final_state pre_norm"):
        final_norm(p, load_config(p))


# ---------------------------------------------------------------------------- a launched server's lifetime

FAKE_SERVER = """import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def fake_command(tmp_path: Path) -> EngineCommand:
    """A process standing in for a vLLM server: answers /health, as `VLLMServer` starts one."""
    port = free_port("127.0.0.1")
    return EngineCommand([sys.executable, "-c", FAKE_SERVER, str(port)], {}, f"http://127.0.0.1:{port}/v1",
                         tmp_path / "engine" / "vllm_hidden.log", 60.0)


LAUNCHER = """import pickle, sys, time
from eagle3data.generate.backends.vllm_server import VLLMServer
srv = VLLMServer(pickle.loads(bytes.fromhex(sys.argv[1])), progress=False).start()
print(srv.proc.pid, flush=True)
time.sleep(3600)
"""


def test_a_killed_launcher_takes_its_server_with_it(tmp_path):
    import pickle

    cmd = fake_command(tmp_path)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, pickle.dumps(cmd).hex()], stdout=subprocess.PIPE,
                                text=True)
    server = psutil.Process(int(launcher.stdout.readline()))
    assert server.is_running() and os.getpgid(server.pid) == server.pid != os.getpgid(launcher.pid)  # own session
    assert orjson.loads(cmd.record.read_bytes())["pid"] == server.pid
    launcher.kill()  # SIGKILL: no handler, no finally runs
    launcher.wait()
    server.wait(timeout=60)  # PR_SET_PDEATHSIG: the kernel SIGTERMs it (bound only so a failure does not hang)
    assert not server.is_running()


def test_the_next_start_stops_a_server_left_by_a_dead_launcher(tmp_path, capsys):
    cmd = fake_command(tmp_path)
    cmd.log.parent.mkdir(parents=True)
    stale = subprocess.Popen(cmd.argv, start_new_session=True)  # left running; its launcher is gone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rec = {"pid": stale.pid, "pgid": stale.pid, "started": psutil.Process(stale.pid).create_time(),
           "launcher_pid": dead.pid, "launcher_started": 1.0}
    cmd.record.write_bytes(orjson.dumps(rec))
    new = fake_command(tmp_path)
    with VLLMServer(new) as srv:
        assert stale.wait(timeout=60) is not None  # stopped before the new one started
        assert orjson.loads(new.record.read_bytes())["pid"] == srv.proc.pid
        pid = srv.proc.pid
    assert f"left running by an earlier launch (pid {stale.pid}" in capsys.readouterr().out
    assert not new.record.exists() and not psutil.pid_exists(pid)
    # a record whose launcher still runs (another eagle3data owns that server): refused, nothing stopped
    other = subprocess.Popen(fake_command(tmp_path).argv, start_new_session=True)
    rec = {"pid": other.pid, "pgid": other.pid, "started": psutil.Process(other.pid).create_time(),
           "launcher_pid": os.getppid(), "launcher_started": psutil.Process(os.getppid()).create_time()}
    new.record.write_bytes(orjson.dumps(rec))
    try:
        with pytest.raises(ServerError, match=rf"a vLLM server \(pid {other.pid}\) launched by pid {os.getppid()}"):
            VLLMServer(fake_command(tmp_path)).start()
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
