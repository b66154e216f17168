"""The real engine: vLLM's CPU build (`make engine`, `.engine/`) started by the tests, never a fake.

(a) 01 with `generate.backend: vllm` and `generate.vllm.launch: true` gives the exact ids of the local
backend on the ci prompts; (b) 04 via vLLM (extract_hidden_states, the project's CPU connector) stores
what 04 via HF stores on the same mix: same keys and order, every aux layer, the pre-norm and the
post-norm state within the HF path's own tolerance (tests/test_hidden.py: one bf16 ulp); both
trainers' loaders read the vLLM store; 04's own verify recomputes through that server (clean: passes)
and `verify-hidden` through it catches a changed sample; (c) the documented CLI command with a
launched server: Ctrl-C mid-capture keeps what came back, a SIGKILLed run takes its kernel and
server with it, and the resume stores every sample once, equal to an uninterrupted capture.
The hidden-states server is started once for the module (and stopped before the CLI launches its
own: one server at a time). Skipped, with the reason, only where the engine venv is absent
(`make test` builds it first).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil
import pytest
import torch

from eagle3data.core.params import load_params
from eagle3data.core.records import scan_journal
from eagle3data.generate.backends.vllm_server import VLLMServer, engine_python
from eagle3data.generate.run import run_generate
from eagle3data.hidden.capture import layer_plan, load_config
from eagle3data.hidden.extract import run_extract
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store.format import read_shard_meta, shard_dir
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.verify.command import verify_cli
from runfiles import as_written, wait_figure
from eagle3data.hidden.engines.vllm_capture import hidden_command

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


def test_01_at_temperature_1_through_a_launched_vllm_server_is_seeded_and_sampled(ci_run, tmp_path):
    """vLLM's CPU build samples noise (its expand_kernel shim leaves the temperature unset) or dies (a seeded chunked
    prefill's set_offset) at T > 0 without the fixes 01 puts on its server's PYTHONPATH: every request answered,
    the same seed gives the same ids, and the ids are not the greedy ones nor noise (the target's own text)."""
    from eagle3data.core.models import tokenizer_for

    runs = []
    for name in ("a", "b"):
        p = load_params(CI, {"output_root": str(tmp_path / name), "generate.backend": "vllm",
                             "generate.vllm.launch": True, "generate.vllm.server.port": 0, "generate.concurrency": 4,
                             "generate.sampling.temperature": 1.0, "generate.sampling.seed": 0})
        s = run_generate(p, progress=False)
        assert s.status == "finished" and s.new_records == len(ids_by_key(ci_run))
        mark = next((p.run_dir / "engine" / "vllm_cpu_fix").glob("mark_generate.txt")).read_text()
        assert "expand: applied" in mark and "rewind: applied" in mark and "not applied" not in mark
        runs.append((p, ids_by_key(p)))
    (p, a), (_, b) = runs
    assert a == b  # seeded: the same ids again
    greedy = ids_by_key(ci_run)
    assert any(a[k][1] != greedy[k][1] for k in a)  # sampled, not greedy
    tok = tokenizer_for(p)
    text = " ".join(tok.decode(o) for _, o in a.values())
    assert sum(c.isascii() and (c.isalnum() or c.isspace()) for c in text) / len(text) > 0.8, text[:300]


class SharedServer:
    """The module's one extract_hidden_states server (the project's CPU connector, float32): started on first
    use, stopped by `stop()` (before a test that launches its own) or at the module's end."""

    def __init__(self, params, files: Path):
        self.params, self.files, self.srv = params, files, None

    def get(self) -> VLLMServer:
        if self.srv is None:
            p = self.params
            self.srv = VLLMServer(hidden_command(p, layer_plan(p, load_config(p))), progress=False).start()
        return self.srv

    def stop(self) -> None:
        srv, self.srv = self.srv, None
        if srv is not None:
            srv.stop()


@pytest.fixture(scope="module")
def hidden_server(ci_run, tmp_path_factory):
    files = tmp_path_factory.mktemp("engine_files")
    p = load_params(CI, {"output_root": str(tmp_path_factory.mktemp("srv")), "hidden.backend": "vllm",
                         "hidden.vllm": {"launch": True, "files_dir": str(files), "server": {"port": 0}}})
    shared = SharedServer(p, files)
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def both_stores(ci_run, hidden_server, tmp_path_factory):
    """04 on the ci mix via HF and via the vLLM server, each into its own store (final_state both)."""
    from eagle3data.core.models import model_for

    srv = hidden_server.get()
    out = {}
    for backend in ("hf", "vllm"):
        root = tmp_path_factory.mktemp(f"store_{backend}")
        shutil.copytree(ci_run.run_dir / "records", root / "ci" / "records")
        over = {"output_root": str(root), "hidden.probe_batches": 0, "hidden.backend": backend,
                "hidden.storage": "bf16", "export.draft_vocab_size": 64}  # the engine's states as captured
        if backend == "vllm":
            over["hidden.vllm"] = {"base_url": srv.base_url, "concurrency": 4}
        p = load_params(CI, over)
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("WORLD_SIZE", raising=False)
            mp.delenv("RANK", raising=False)
            res = run_extract(p, progress=False, model=model_for(p) if backend == "hf" else None)
        assert res.merged and res.validation.ok, (backend, res.stats)
        # 04's own verify recomputed its samples through the backend that made the store: the same server
        v = res.verification.summary
        assert v["recomputed"] == min(p.hidden.verify_recompute, len(res.index)) > 0 and v["ok"], (backend, v)
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
    assert not list(hidden_server.files.iterdir())  # the engine's files were deleted once stored


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


def test_verify_hidden_through_the_server_catches_a_changed_sample(both_stores, tmp_path, capsys):
    """`verify-hidden --recompute all` on the vLLM store: clean, every sample recomputed by the server and
    passing (exit 0); one sample's aux_mid scaled by 1% (no statistic sees it): that sample fails recompute."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    p, _ = both_stores["vllm"]
    assert verify_cli(str(p.run_dir), recompute="all", positions=0, out=str(tmp_path / "clean.jsonl")) == 0
    clean = [orjson.loads(x) for x in (tmp_path / "clean.jsonl").read_bytes().splitlines()]
    assert all("recompute" in r for r in clean) and not any(r["failed"] for r in clean)
    copy = tmp_path / "run"
    shutil.copytree(p.run_dir, copy)
    rd = HiddenReader(copy / "hidden")
    key = rd.keys()[2]
    row = rd.index.iloc[2]
    f = copy / "hidden" / row["shard"]
    with safe_open(str(f), framework="pt") as h:
        meta = h.metadata()
    t = load_file(str(f))
    a, n = int(row["offset"]), int(row["length"])
    t["hidden_states"][a:a + n, 1] = (t["hidden_states"][a:a + n, 1].float() * 1.01).to(torch.bfloat16)
    save_file(t, str(f), metadata=meta)
    as_written(copy / "hidden", f)  # as the engine wrote it (the recompute is under test, not the checksum)
    capsys.readouterr()
    assert verify_cli(str(copy), recompute="all", positions=0, out=str(tmp_path / "bad.jsonl")) == 1
    bad = {r["key"]: r["failed"] for r in map(orjson.loads, (tmp_path / "bad.jsonl").read_bytes().splitlines())}
    assert [k for k, v in bad.items() if v] == [key] and "recompute" in bad[key], bad
    assert f"FAIL {key}: " in capsys.readouterr().out


# ---------------------------------------------------------------------------- (c) the CLI with a launched server

COPIES = 4  # copies of each ci record (ids made distinct): a mix long enough to stop in the middle of


def many_records(ci_run, root: Path) -> None:
    """The ci run's records, each `COPIES` times with its own sample id and prompt ids (one more token)."""
    out = root / "ci" / "records"
    out.mkdir(parents=True)
    for f in sorted((ci_run.run_dir / "records").glob("*.jsonl")):
        rows = []
        for r in scan_journal(f).records:
            for k in range(COPIES):
                ids = list(r["prompt_ids"])
                rows.append({**r, "sample_id": f"{r['sample_id']}-{k}", "prompt_ids": [*ids[:3], 1000 + k, *ids[3:]]})
        (out / f.name).write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in rows))


def cli_04(root: Path) -> subprocess.Popen:
    """The documented command (docs/04): `eagle3data run PARAMS --only 04 -p hidden.backend vllm -p
    hidden.vllm.launch true`, here on the ci params, one request in flight."""
    over = {"output_root": str(root), "hidden.backend": "vllm", "hidden.vllm.launch": "true",
            "hidden.vllm.concurrency": "1", "hidden.vllm.server.port": "0", "hidden.probe_batches": "0",
            "hidden.verify_after": "false", "hidden.shard_bytes": "262144",
            "hidden.storage": "bf16"}  # compared with one uninterrupted store: 8-bit scales follow each shard's samples
    args = [a for k, v in over.items() for a in ("-p", k, v)]
    return subprocess.Popen([sys.executable, "-m", "eagle3data", "run", str(CI), "--only", "04", *args], cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def server_of(files: Path) -> list[psutil.Process]:
    """The launched server's process group (found by its files folder on its command line), or []."""
    for proc in psutil.process_iter(["cmdline"]):
        if str(files) in " ".join(proc.info["cmdline"] or []):
            pgid = os.getpgid(proc.pid)
            return [q for q in psutil.process_iter() if _pgid(q.pid) == pgid]
    return []


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def stored(run_dir: Path) -> list[str]:
    return [e["key"] for f in shard_dir(run_dir / "hidden").glob("*.safetensors") for e in read_shard_meta(f)["samples"]]


def test_ctrl_c_then_a_killed_run_then_resume_through_the_cli(ci_run, hidden_server, tmp_path):
    """Ctrl-C during a vLLM-backed 04 (the documented CLI command, a launched server) stops with what came
    back stored and the server gone; a run killed outright (SIGKILL) takes its kernel and its server with it;
    the resume stores every sample exactly once, states equal to an uninterrupted capture."""
    from eagle3data.core.models import model_for  # noqa: F401  (the ci model prepared in this process)

    whole = tmp_path / "whole"
    many_records(ci_run, whole)
    p_whole = load_params(CI, {"output_root": str(whole), "hidden.probe_batches": 0, "hidden.backend": "vllm",
                               "hidden.verify_after": False, "hidden.storage": "bf16",
                               "hidden.vllm": {"base_url": hidden_server.get().base_url, "concurrency": 4}})
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WORLD_SIZE", raising=False)
        mp.delenv("RANK", raising=False)
        ref = run_extract(p_whole, progress=False)
    assert ref.merged and ref.stats["failed"] == 0
    n = len(ref.index)
    hidden_server.stop()  # one server at a time: the CLI launches its own

    root = tmp_path / "cli"
    many_records(ci_run, root)
    run_dir, files = root / "ci", root / "ci" / "hidden" / "engine_files"
    proc, t0 = cli_04(root), time.time()  # 1. Ctrl-C once progress shows
    wait_figure(run_dir, "extracted", 2, proc, t0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate()
    assert proc.returncode == 3 and "stopped: SIGINT" in err and "04_extract_hidden stopped" in err, (out, err)
    first = stored(run_dir)
    assert 2 <= len(first) < n and len(set(first)) == len(first)  # what came back before the stop is on disk
    assert not server_of(files)  # the launched server is gone

    proc, t0 = cli_04(root), time.time()  # 2. killed outright mid-capture: its kernel and server go with it
    wait_figure(run_dir, "extracted", 2, proc, t0)
    doomed = server_of(files) + psutil.Process(proc.pid).children(recursive=True)
    assert server_of(files)
    proc.kill()
    proc.communicate()
    gone, alive = psutil.wait_procs(doomed, timeout=120)  # the bound only keeps a failure from hanging
    assert not alive, [(q.pid, q.name()) for q in alive]

    proc = cli_04(root)  # 3. resume: completes
    out, err = proc.communicate()
    assert proc.returncode == 0, (out, err)
    keys = stored(run_dir)
    assert len(keys) == len(set(keys)) == n  # every sample exactly once
    assert set(first) <= set(keys) and not server_of(files)
    got, want = HiddenReader(run_dir / "hidden"), HiddenReader(hidden_dir(p_whole))
    assert got.keys() == want.keys()
    for key in want.keys():
        x, y = want.sample(key)["hidden_states"].float(), got.sample(key)["hidden_states"].float()
        torch.testing.assert_close(y, x, rtol=2**-7, atol=1e-2, msg=key)
