"""A sample the engine failed is a failed stage (issue 52), and the engine settings 04 needs are set or refused.

Without a server: an HF capture whose sample comes back with NaN fails 04 in one line naming the ledger, merges
nothing, and 05 refuses (exit 2) to export a hand-off without states; `hidden.allow_failed_samples` accepts it
(the merge takes it out of the mix as `capture_failed`, named in index.json and 05's manifest); a rerun retries it
and completes. A vLLM server that publishes prefix caching on, and the SGLang and vLLM settings rules, are refused
before the first sample. With the real engines (`.sglang/`, `.engine/`; slow): an SGLang server started elsewhere with
a chunk shorter than a sample is refused before any request, after showing that it does cut that sample's states;
04 through launched SGLang servers stores a sample longer than that chunk whole; the engine 04 launched killed
(SIGKILL) mid-capture, SGLang and vLLM: exit 1 with one line naming its log, no server left, and the same command
again completes with every sample stored once.
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import psutil
import pytest
import torch

from eagle3data.core.params import load_params
from eagle3data.core.records import scan_journal
from eagle3data.hidden.capture import Capture, layer_plan, load_config
from eagle3data.hidden.engines.settings import (PREFIX_CACHING_OFF, cache_config_info, chunked_prefill_problem,
                                                settings_problem)
from eagle3data.hidden.engines.sglang_capture import aux_command
from eagle3data.hidden.extract import run_extract
from eagle3data.hidden.store.failures import SamplesFailed, StatesNotMerged
from eagle3data.hidden.mix import build_mix, hidden_dir, read_mix
from eagle3data.hidden.store.format import INDEX_FILE, INFO_FILE
from eagle3data.hidden.store.reader import HiddenReader
from runfiles import wait_figure

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "params" / "ci.yaml"


@pytest.fixture(autouse=True)
def one_worker(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def hf_params(root: Path, **over):
    return load_params(CI, {"output_root": str(root), "hidden.probe_batches": 0, "hidden.storage": "bf16",
                            "hidden.verify_after": False, "export.allow_unverified": True,
                            "export.draft_vocab_size": 64, **over})


def poison(monkeypatch, ids: list[int]) -> None:
    """The HF forward gives NaN for the sample with these ids (and the right states for every other)."""
    real = Capture.run

    def run(self, input_ids, mask):
        out = real(self, input_ids, mask)
        for r in range(input_ids.shape[0]):
            n = input_ids.shape[1] if mask is None else int(mask[r].sum())  # one sequence alone: no mask
            if n == len(ids) and input_ids[r, : len(ids)].tolist() == ids:
                out[r, 0, 0] = float("nan")
        return out

    monkeypatch.setattr(Capture, "run", run)


def test_a_failed_sample_fails_04_and_05_then_allowed_or_retried(ci_run, tmp_path, monkeypatch, capsys):
    from eagle3data.cli import main
    from eagle3data.export.run import export_format

    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    p = hf_params(tmp_path)
    hdir = hidden_dir(p)
    target = build_mix(p, write=False).samples[0]
    poison(monkeypatch, target.input_ids)
    with pytest.raises(SamplesFailed) as e:
        run_extract(p, progress=False)
    line = str(e.value)
    n = len(read_mix(hdir).samples)
    assert "\n" not in line and re.match(f"1 of {n} samples failed after their retries, first {target.key}: hidden "
                                         r"states hold \d+ NaN or inf values; ledger: ", line), line
    assert str(hdir / "failed_samples.json") in line and "hidden.allow_failed_samples" in line
    assert e.value.status == 1 and not (hdir / INDEX_FILE).exists()  # nothing merged
    rec = orjson.loads((hdir / "failed_samples.json").read_bytes())
    assert [f["key"] for f in rec["failures"]] == [str(target.key)] and rec["backend"] == "hf"

    # 05: a hand-off that needs the states is refused before anything is written (exit 2, one line)
    with pytest.raises(StatesNotMerged, match=f"04 did not merge the hidden states \\(1 sample failed, first "
                                              f"{target.key}"):
        export_format(p, tmp_path / "out", "specforge")
    assert not (tmp_path / "out").exists()
    capsys.readouterr()
    assert main(["export", str(p.run_dir), "--format", "speculators", "--out", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "index.parquet is missing: 04 did not merge" in err and not (tmp_path / "out2").exists()
    # `eagle3data run --only 05` refuses it in its preflight (exit 2, one line) before any notebook starts
    from eagle3data.preflight import ready_problems

    (problem,) = ready_problems(p, ["05_export"])
    assert problem.startswith("export.formats: ") and "04 did not merge the hidden states" in problem
    assert ready_problems(p, ["04_extract_hidden", "05_export"]) == []  # 04 in the same run may merge it first

    # hidden.allow_failed_samples 1: merged without it, named in index.json, the mix manifest and 05's manifest
    p1 = hf_params(tmp_path, **{"hidden.allow_failed_samples": 1})
    res = run_extract(p1, progress=False)
    assert res.merged and res.validation.ok and len(res.index) == n - 1
    info = orjson.loads((hdir / INFO_FILE).read_bytes())
    assert [f["key"] for f in info["failed_samples"]] == [str(target.key)] and "NaN" in info["failed_samples"][0]["error"]
    mix = read_mix(hdir)
    assert str(target.key) not in [str(s.key) for s in mix.samples] and len(mix.samples) == n - 1
    (drop,) = [d for d in mix.dropped if d["reason"] == "capture_failed"]
    assert drop["key"] == str(target.key) and mix.manifest["samples"] == n - 1
    m = export_format(p1, tmp_path / "allowed", "specforge")
    assert m["exported"] == n - 1 and m["skipped"].get("capture_failed") == 1

    # the same command again, the engine fine: the mix is rebuilt with the sample, it is retried, all stored
    monkeypatch.undo()
    again = run_extract(p, progress=False)
    assert again.merged and again.validation.ok and again.stats["to_extract"] == 1 and len(again.index) == n
    assert not (hdir / "failed_samples.json").exists() and not orjson.loads((hdir / INFO_FILE).read_bytes())["failed_samples"]


def test_engine_settings_that_cut_states_are_named():
    assert chunked_prefill_problem({"chunked_prefill_size": -1}, 9000, 16) is None
    assert chunked_prefill_problem({"chunked_prefill_size": None}, 9000, 16) is None
    assert chunked_prefill_problem({"chunked_prefill_size": 8192}, 300, 1) is None  # alone in its batch, fits
    for info, longest, conc in (({"chunked_prefill_size": 8192}, 300, 4), ({"chunked_prefill_size": 128}, 300, 1)):
        why = chunked_prefill_problem(info, longest, conc)
        assert why and why.endswith("start it with --chunked-prefill-size -1"), why
    assert cache_config_info('# HELP x\nvllm:cache_config_info{block_size="16",enable_prefix_caching="True"} 1.0') \
        == {"block_size": "16", "enable_prefix_caching": "True"}
    on = {"enable_prefix_caching": "True"}
    assert PREFIX_CACHING_OFF in settings_problem(on, 8192, 100, launched=False)
    assert settings_problem({"enable_prefix_caching": "False"}, 8192, 100, launched=True) is None
    assert settings_problem(None, 8192, 100, launched=False) is None  # not published: each file's rows are checked
    assert "cannot check" in settings_problem(None, 8192, 100, launched=True)
    assert "--max-model-len 9000" in settings_problem({"enable_prefix_caching": "False"}, 8192, 9000, launched=False)


class FakeVLLM(http.server.BaseHTTPRequestHandler):
    """A vLLM-shaped server that lists the model and publishes prefix caching on; counts completions."""

    completions: list[str] = []

    def do_GET(self):
        if self.path == "/v1/models":
            body = orjson.dumps({"object": "list", "data": [{"id": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                              "root": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                              "max_model_len": 8192}]})
        elif self.path == "/metrics":
            body = b'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0"} 1.0\n'
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        FakeVLLM.completions.append(self.path)
        self.send_response(500)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_a_vllm_server_with_prefix_caching_is_refused_before_the_first_sample(ci_run, tmp_path):
    from eagle3data.generate.backends.engine import GenerateError

    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        p = hf_params(tmp_path, **{"hidden.backend": "vllm", "hidden.vllm": {
            "base_url": f"http://127.0.0.1:{srv.server_address[1]}/v1", "max_retries": 0}})
        with pytest.raises(GenerateError, match=r"runs with prefix caching on .*start it with "
                                                r"--no-enable-prefix-caching$") as e:
            run_extract(p, progress=False)
    finally:
        srv.shutdown()
    assert "\n" not in str(e.value) and FakeVLLM.completions == []


# ---------------------------------------------------------------------------- the real engines (slow)

SGLANG = REPO / ".sglang" / "bin" / "python"
ENGINE = REPO / ".engine" / "bin" / "python"
CHUNK = 64  # the truncating server's chunk: shorter than the long sample below
LONG = 150


def long_records(ci_run, root: Path) -> None:
    """The ci run's records plus one whose prompt is LONG tokens (its own ids repeated: in the vocabulary)."""
    out = root / "ci" / "records"
    shutil.copytree(ci_run.run_dir / "records", out)
    f = sorted(out.glob("*.jsonl"))[0]
    r = scan_journal(f).records[0]
    ids = list(r["prompt_ids"])
    prompt = (ids * (LONG // len(ids) + 1))[:LONG]
    with open(f, "ab") as fh:
        fh.write(orjson.dumps({**r, "sample_id": "long", "prompt_ids": prompt}) + b"\n")


def cli_run(root: Path, backend: str) -> subprocess.Popen:
    over = {"output_root": str(root), "hidden.backend": backend, f"hidden.{backend}.launch": "true",
            f"hidden.{backend}.concurrency": "1", f"hidden.{backend}.server.port": "0", "hidden.probe_batches": "0",
            "hidden.verify_after": "false", "hidden.storage": "bf16", "hidden.shard_bytes": "262144"}
    if backend == "sglang":
        over["hidden.final_state"] = "post_norm"
    args = [a for k, v in over.items() for a in ("-p", k, v)]
    return subprocess.Popen([sys.executable, "-m", "eagle3data", "run", str(CI), "--only", "04", *args], cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def kill_engine(record: Path) -> list[psutil.Process]:
    """SIGKILL the launched server's main process (its record); the rest of its group, to watch go."""
    rec = orjson.loads(record.read_bytes())
    group = [q for q in psutil.process_iter() if _pgid(q.pid) == rec["pgid"]]
    os.kill(rec["pid"], signal.SIGKILL)
    return group


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def killed_then_resumed(root: Path, backend: str, figure: str, record: Path) -> None:
    """The documented command, its engine killed once 2 samples are through `figure`: exit 1, one line naming the
    log, no traceback, no server left; the same command again: exit 0."""
    proc, t0 = cli_run(root, backend), time.time()
    wait_figure(root / "ci", figure, 2, proc, t0)
    group = kill_engine(record)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, (out, err)
    last = err.strip().splitlines()[-1]
    log = record.with_name(record.name.replace(".pid.json", ".log"))
    assert "died during the capture" in last and "(killed by SIGKILL)" in last and str(log) in last, err
    assert "Traceback" not in err and "Traceback" not in out
    _, alive = psutil.wait_procs(group, timeout=60)
    assert not alive, [(q.pid, q.name()) for q in alive]  # nothing of the server left
    proc = cli_run(root, backend)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, (out, err)


def stored_keys(hdir: Path) -> list[str]:
    from eagle3data.hidden.store.format import read_shard_meta, shard_dir

    return [e["key"] for f in shard_dir(hdir).glob("*.safetensors") for e in read_shard_meta(f)["samples"]]


@pytest.mark.slow
@pytest.mark.skipif(not SGLANG.exists(), reason=f"no SGLang venv ({SGLANG}): run `make sglang` (make test does)")
def test_sglang_chunk_refused_then_a_long_sample_whole_through_a_killed_and_resumed_capture(ci_run, tmp_path):
    from eagle3data.generate.backends.sglang_server import SGLangServer

    root = tmp_path / "sg"
    long_records(ci_run, root)
    p = load_params(CI, {"output_root": str(root), "hidden.backend": "sglang", "hidden.final_state": "post_norm",
                         "hidden.probe_batches": 0, "hidden.storage": "bf16", "hidden.verify_after": False,
                         "hidden.sglang": {"launch": True, "server": {"port": 0}}})
    layers, config = layer_plan(p, load_config(p)), load_config(p)
    cmd = aux_command(p, layers, config, stage="chunked")
    i = cmd.argv.index("--chunked-prefill-size")
    cmd.argv[i + 1] = str(CHUNK)  # a server started elsewhere with a chunk shorter than the long sample
    with SGLangServer(cmd, progress=False) as srv:
        # the hazard is real on this engine: the long sample comes back with its last chunk's rows only
        r = httpx.post(srv.base_url + "/generate", timeout=300, json={
            "input_ids": read_long(root), "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}).json()
        assert len(r["meta_info"]["hidden_states"][0]) < LONG
        ext = load_params(CI, {"output_root": str(root), "hidden.backend": "sglang", "hidden.final_state": "post_norm",
                               "hidden.probe_batches": 0, "hidden.sglang": {"base_url": srv.base_url,
                                                                             "final_url": srv.base_url}})
        from eagle3data.generate.backends.engine import GenerateError

        with pytest.raises(GenerateError, match=f"runs with chunked prefill on \\(chunked_prefill_size {CHUNK}; the "
                                                r"mix's longest sample has \d+ tokens\).*start it with "
                                                "--chunked-prefill-size -1$") as e:
            run_extract(ext, progress=False)
        assert "\n" not in str(e.value)
        assert not (hidden_dir(ext) / "sglang_aux_ledger.json").exists()  # refused before the first request
        assert not list((hidden_dir(ext) / "sglang_aux").glob("*.safetensors"))

    # 04's own servers (chunked prefill off): the aux server killed mid-pass, then the same command completes
    killed_then_resumed(root, "sglang", "staged", root / "ci" / "engine" / "sglang_hidden_aux.pid.json")
    hdir = hidden_dir(p)
    keys = stored_keys(hdir)
    mix = read_mix(hdir)
    assert len(keys) == len(set(keys)) == len(mix.samples) and "long" in {s.sample_id for s in mix.samples}
    hf_root = tmp_path / "hf"
    long_records(ci_run, hf_root)
    p_hf = hf_params(hf_root, **{"hidden.final_state": "post_norm"})
    ref = run_extract(p_hf, progress=False)
    got, want = HiddenReader(hdir), HiddenReader(hidden_dir(p_hf))
    assert ref.merged and got.keys() == want.keys()
    for key in want.keys():  # the long sample whole, every sample within bf16 of HF's
        x, y = want.sample(key)["hidden_states"].float(), got.sample(key)["hidden_states"].float()
        assert x.shape == y.shape, key
        torch.testing.assert_close(y, x, rtol=2**-7, atol=1e-2, msg=key)


def read_long(root: Path) -> list[int]:
    for f in sorted((root / "ci" / "records").glob("*.jsonl")):
        for r in scan_journal(f).records:
            if r["sample_id"] == "long":
                return list(r["prompt_ids"]) + list(r["output_ids"])
    raise AssertionError("no long record")


@pytest.mark.slow
@pytest.mark.skipif(not ENGINE.exists(), reason=f"no engine venv ({ENGINE}): run `make engine` (make test does)")
def test_the_vllm_server_04_launched_killed_mid_capture_then_the_same_command_completes(ci_run, tmp_path):
    from test_vllm_engine import many_records

    root = tmp_path / "vl"
    many_records(ci_run, root)
    killed_then_resumed(root, "vllm", "extracted", root / "ci" / "engine" / "vllm_hidden.pid.json")
    hdir = root / "ci" / "hidden"
    keys = stored_keys(hdir)
    assert len(keys) == len(set(keys)) == len(read_mix(hdir).samples)  # every sample exactly once
    assert HiddenReader(hdir).keys() == [str(s.key) for s in read_mix(hdir).samples]
    log = (root / "ci" / "engine" / "vllm_hidden.log").read_text()
    assert PREFIX_CACHING_OFF in log.splitlines()[0]
