"""01_generate's `vllm` backend against a vLLM-shaped loopback server (tests/loopback.py, kind "vllm").

Token-id prompts go to `/v1/completions` with `return_token_ids`; records keep the ids the
server sampled (end-of-turn included) as `source: vllm`, `ids_exact: true`; `/v1/models`
is checked before anything is sent; faults, budgets, SIGKILL + resume and SIGINT behave as
for the other HTTP backends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from eagle3data.generate.backends.engine import GenerateError
from eagle3data.generate.run import run_generate
from eagle3data.generate.ledger import read_ledger
from eagle3data.core.params import load_params
from eagle3data.core.records import Record, scan_journal

sys.path.insert(0, str(Path(__file__).parent))
from loopback import LoopbackServer  # noqa: E402
from runfiles import assert_ledger_adds_up  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVED = "smollm2-served"


def write_prompts(path: Path, n: int) -> Path:
    with open(path, "wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"sample_id": i, "messages": [
                {"role": "user", "content": f"Question {i}: " + "how do we compute this? " * (1 + i % 5)}]}) + b"\n")
    return path


def overrides(tmp_path: Path, srv: LoopbackServer, n: int, **over) -> dict:
    p = write_prompts(tmp_path / "prompts_0.jsonl", n)
    o = {"output_root": str(tmp_path / "out"), "run_name": "run", "datasets": [{"name": "d0", "path": str(p)}],
         "generate.backend": "vllm", "generate.vllm": {"base_url": srv.base_url},
         "generate.concurrency": 4, "generate.timeout_s": 5, "generate.retry_backoff_s": 0.01,
         "generate.retry_backoff_max_s": 0.05, "generate.max_retries": 2, "generate.ledger_interval_s": 0.05,
         "generate.stop_grace_s": 5}
    o.update(over)
    return o


def make_params(tmp_path: Path, srv: LoopbackServer, n: int = 6, **over):
    return load_params(REPO / "params" / "ci.yaml", overrides(tmp_path, srv, n, **over))


def records(params) -> list[dict]:
    return scan_journal(params.run_dir / "records" / "d0.jsonl").records


def completions(srv: LoopbackServer) -> list[dict]:
    return [r for r in srv.requests if r["path"] == "/completions"]


def test_vllm_run_keeps_output_ids_exact(tmp_path, smollm2_tokenizer):
    from eagle3data.core.profiles import SMOLLM2
    from eagle3data.prompts.load import load_prompts, template_prompt
    from eagle3data.core.spans import output_texts

    with LoopbackServer("vllm", served_model_name=SERVED) as srv:
        params = make_params(tmp_path, srv, n=7, **{"generate.vllm": {"base_url": srv.base_url, "batch_size": 3}})
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        reqs = completions(srv)
        probes = list(srv.probes)
    assert s.status == "finished" and s.new_records == 7
    assert probes and probes[0] < reqs[0]["t"]  # the model check comes before any generation request
    sent = {}
    for r in reqs:
        b = r["body"]
        assert b["model"] == SERVED and b["return_token_ids"] is True and b["max_tokens"] == 24
        assert b["skip_special_tokens"] is False and b["stop_token_ids"] == [2] and "messages" not in b
        for p in (b["prompt"] if isinstance(b["prompt"][0], list) else [b["prompt"]]):
            sent[tuple(p)] = True
    assert any(isinstance(r["body"]["prompt"][0], list) for r in reqs)  # batched
    prompts = {p.sample_id: p for p in load_prompts(params.datasets[0].path).prompts}
    recs = records(params)
    assert sorted(r["sample_id"] for r in recs) == list(range(7))
    for r in recs:
        Record.model_validate(r)
        assert r["source"] == "vllm" and r["ids_exact"] is True
        assert r["prompt_ids"] == template_prompt(smollm2_tokenizer, prompts[r["sample_id"]], SMOLLM2)
        assert tuple(r["prompt_ids"]) in sent
        # the ids the server sampled, end-of-turn kept where the engine produced it
        p = r["prompt_ids"]
        n = 3 + (len(p) + sum(p[-3:])) % 13
        assert r["output_ids"] == [100 + (len(p) * 7 + k * 31) % 4000 for k in range(n)] + [2]
        assert r["finish_reason"] == "stop" and r["native_finish_reason"] == "stop:2"
        assert r["usage"]["completion_tokens"] == len(r["output_ids"])
        text = output_texts(r["output_ids"], SMOLLM2, smollm2_tokenizer)  # the one split, as for SGLang
        assert (r["reasoning"], r["content"]) == (text.reasoning, text.content)
        assert r["generation_id"].startswith("rid-cmpl-")
    led = assert_ledger_adds_up(params.run_dir)
    assert led["source"] == "vllm" and led["datasets"]["d0"]["by_source"]["vllm"]["done"] == 7


def test_length_and_abort_finish_reasons_are_mapped(tmp_path, smollm2_tokenizer):
    with LoopbackServer("vllm") as srv:
        srv.faults.append("abort")
        params = make_params(tmp_path, srv, n=3, **{"generate.concurrency": 1, "generate.sampling.max_new_tokens": 3})
        run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    recs = sorted(records(params), key=lambda r: r["created_at"])
    assert [r["finish_reason"] for r in recs] == ["abort", "length", "length"]
    assert all(len(r["output_ids"]) == 3 and 2 not in r["output_ids"] for r in recs[1:])
    assert recs[1]["native_finish_reason"] == "length" and recs[0]["error"]
    assert_ledger_adds_up(params.run_dir)


@pytest.mark.parametrize("listed, configured, words", [
    ("/models/Qwen3-8B", None, "Qwen3-8B.*refusing to start"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "not-served", "none of them 'not-served'"),
])
def test_model_check_refuses_to_start(tmp_path, smollm2_tokenizer, listed, configured, words):
    with LoopbackServer("vllm", model_path=listed) as srv:
        params = make_params(tmp_path, srv, n=3, **{"generate.vllm": {"base_url": srv.base_url,
                                                                      "model": configured}})
        with pytest.raises(GenerateError, match=words):
            run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        assert not completions(srv)
    assert read_ledger(params.run_dir)["status"] == "refused" and records(params) == []


def test_base_url_without_v1_is_named(tmp_path, smollm2_tokenizer):
    with LoopbackServer("vllm") as srv:
        params = make_params(tmp_path, srv, n=1, **{"generate.vllm": {"base_url": f"http://127.0.0.1:{srv.port}"}})
        with pytest.raises(GenerateError, match="must end in /v1"):
            run_generate(params, progress=False, tokenizer=smollm2_tokenizer)


# -- faults: the same set as the other loopback servers -------------------------------------------

@pytest.mark.parametrize("faults, outcome, words", [
    (["500", "500"], "stop", None),                        # retried, recovers on the third try
    (["500", "500", "500"], "error", "after 3 attempts"),  # retries spent
    (["truncated"], "stop", None),                          # a body cut midway is retried
    (["malformed"], "error", "malformed response"),
    (["prompt_changed"], "error", "changed the prompt"),
    (["no_token_ids"], "error", "return_token_ids"),
])
def test_faults_give_their_outcome(tmp_path, smollm2_tokenizer, faults, outcome, words):
    with LoopbackServer("vllm") as srv:
        srv.faults.extend(faults)
        params = make_params(tmp_path, srv, n=1)
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    (rec,) = records(params)
    assert s.status == "finished" and rec["finish_reason"] == outcome
    if words:
        assert words in rec["error"] and rec["output_ids"] is None and rec["source"] == "vllm"
    else:
        assert rec["ids_exact"] and rec["output_ids"][-1] == 2
    assert_ledger_adds_up(params.run_dir)


def test_429_waits_then_timeout_and_402(tmp_path, smollm2_tokenizer):
    with LoopbackServer("vllm", retry_after="1", slow_s=1.0) as srv:
        srv.faults.append("429")
        params = make_params(tmp_path, srv, n=1)
        run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        reqs = completions(srv)
        assert [r["fault"] for r in reqs] == ["429", None] and reqs[1]["t"] - reqs[0]["t"] >= 0.95
        srv.always = "slow"
        p2 = make_params(tmp_path, srv, n=1, run_name="slow", **{"generate.timeout_s": 0.2,
                                                                "generate.max_retries": 0})
        run_generate(p2, progress=False, tokenizer=smollm2_tokenizer)
        srv.faults.extend(["ok", "ok"])
        srv.always = "402"
        p3 = make_params(tmp_path, srv, n=6, run_name="nocredit", **{"generate.concurrency": 1})
        s3 = run_generate(p3, progress=False, tokenizer=smollm2_tokenizer)
    assert records(params)[0]["finish_reason"] == "stop"
    assert "timeout" in records(p2)[0]["error"]
    assert s3.status == "stopped" and "402" in s3.stop_reason and len(records(p3)) == 2
    assert assert_ledger_adds_up(p3.run_dir)["datasets"]["d0"]["skipped"] == 4


def test_token_budget_holds(tmp_path, smollm2_tokenizer):
    budget, conc = 1500, 3
    with LoopbackServer("vllm", latency=0.005) as srv:
        params = make_params(tmp_path, srv, n=60, **{"generate.concurrency": conc,
                                                     "generate.reserve_completion_tokens": 16})
        params.datasets[0].token_budget = budget
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    recs = records(params)
    used = sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in recs)
    biggest = max(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in recs)
    d = assert_ledger_adds_up(params.run_dir)["datasets"]["d0"]
    assert s.status == "finished" and d["budget_reached"] and d["skipped"] > 0
    # dispatch stops once done + reserved (16 + prompt per request in flight) reaches the budget
    assert budget - conc * biggest <= used <= budget + conc * biggest


# -- kill, resume, stop ---------------------------------------------------------------------------

def _spawn(o: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "eagle3data", "generate", str(REPO / "params" / "ci.yaml"), "--quiet"]
    for k, v in o.items():
        cmd += ["-p", k, orjson.dumps(v).decode() if not isinstance(v, str) else v]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_lines(path: Path, n: int, proc: subprocess.Popen) -> None:
    while not path.exists() or path.read_bytes().count(b"\n") < n:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.02)


def test_sigkill_mid_flight_then_resume_gives_each_sample_once(tmp_path, smollm2_tokenizer):
    n = 50
    with LoopbackServer("vllm", latency=0.05, jitter=0.3) as srv:
        o = overrides(tmp_path, srv, n, **{"generate.concurrency": 6, "generate.timeout_s": 10})
        proc = _spawn(o)
        journal = tmp_path / "out" / "run" / "records" / "d0.jsonl"
        _wait_lines(journal, 8, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_at = journal.read_bytes().count(b"\n")
        assert killed_at < n
        params = load_params(REPO / "params" / "ci.yaml", o)
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    recs = records(params)
    assert sorted(r["sample_id"] for r in recs) == list(range(n))  # every sample exactly once
    assert all(r["source"] == "vllm" and r["ids_exact"] and r["output_ids"][-1] == 2 for r in recs)
    assert s.new_records == n - killed_at
    assert assert_ledger_adds_up(params.run_dir)["datasets"]["d0"]["resumed"] == killed_at


def test_sigint_waits_for_in_flight(tmp_path):
    with LoopbackServer("vllm", latency=0.3) as srv:
        o = overrides(tmp_path, srv, 100, **{"generate.concurrency": 4, "generate.timeout_s": 10})
        proc = _spawn(o)
        _wait_lines(tmp_path / "out" / "run" / "records" / "d0.jsonl", 4, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate()
        sent = len(completions(srv))
    assert proc.returncode == 3, err.decode()
    params = load_params(REPO / "params" / "ci.yaml", o)
    led = assert_ledger_adds_up(params.run_dir)
    d = led["datasets"]["d0"]
    assert led["status"] == "stopped" and "SIGINT" in led["stop_reason"] and d["cancelled"] == 0
    assert d["done"] == sent == len(records(params))
