"""01_generate HTTP backends against real loopback servers on 127.0.0.1 (tests/loopback.py).

Each server fault gives its documented outcome; budgets and the cost cap hold within the
in-flight bound; a run killed with SIGKILL resumes to every sample exactly once; SIGINT and
the STOP file leave a ledger that adds up; the API key never reaches a file.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
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
KEY_ENV = "EAGLE3DATA_TEST_KEY"
KEY = "sk-or-v1-loopback-3f9a1c77e2d54b0b9d1e-SECRET"


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def write_prompts(path: Path, n: int, *, tools_every: int = 4, start: int = 0) -> Path:
    """n prompts; every `tools_every`-th one has a tool definition."""
    with open(path, "wb") as f:
        for i in range(start, start + n):
            obj = {"sample_id": i, "messages": [
                {"role": "user", "content": f"Question {i}: " + "how do we compute this? " * (1 + i % 5)}]}
            if tools_every and i % tools_every == 0:
                obj["tools"] = [{"type": "function", "function": {
                    "name": "lookup", "description": "Look a thing up.",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
            f.write(orjson.dumps(obj) + b"\n")
    return path


def make_params(tmp_path: Path, srv: LoopbackServer, n: int = 6, datasets: int = 1, **over):
    """Params for a run against `srv` with `datasets` prompt files of n prompts each."""
    ds = []
    for d in range(datasets):
        p = write_prompts(tmp_path / f"prompts_{d}.jsonl", n, start=1000 * d)
        ds.append({"name": f"d{d}", "path": str(p)})
    o = {"output_root": str(tmp_path / "out"), "run_name": "run", "datasets": ds,
         "generate.concurrency": 4, "generate.timeout_s": 5, "generate.retry_backoff_s": 0.01,
         "generate.retry_backoff_max_s": 0.05, "generate.max_retries": 2, "generate.ledger_interval_s": 0.05,
         "generate.stop_grace_s": 5}
    if srv.kind == "openai":
        o.update({"generate.backend": "openai", "generate.openai": {
            "base_url": srv.base_url, "model": "moonshotai/kimi-k2.5", "api_key_env": KEY_ENV,
            "provider": {"quantizations": ["int4"], "ignore": ["fp4-provider"], "allow_fallbacks": False},
            "reasoning": {"enabled": True}}})
    else:
        o.update({"generate.backend": "sglang", "generate.sglang": {"base_url": srv.base_url}})
    o.update(over)
    return load_params(REPO / "params" / "ci.yaml", o)


def records(params, dataset: str = "d0") -> list[dict]:
    return scan_journal(params.run_dir / "records" / f"{dataset}.jsonl").records


def assert_adds_up(params) -> dict:
    return assert_ledger_adds_up(params.run_dir)


# -- normal runs ---------------------------------------------------------------------------------

def test_openai_run_records_api_fields(tmp_path, smollm2_tokenizer):
    from eagle3data.core.profiles import SMOLLM2
    from eagle3data.prompts.load import load_prompts, template_prompt

    with LoopbackServer("openai") as srv:
        params = make_params(tmp_path, srv, n=8)
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        reqs = [r for r in srv.requests if r["path"] == "/chat/completions"]
    assert s.status == "finished" and s.new_records == 8
    recs = records(params)
    prompts = {p.sample_id: p for p in load_prompts(params.datasets[0].path).prompts}
    for r in recs:
        Record.model_validate(r)
        assert r["source"] == "api" and r["output_ids"] is None and r["ids_exact"] is False
        assert r["prompt_ids"] == template_prompt(smollm2_tokenizer, prompts[r["sample_id"]], SMOLLM2)
        assert r["reasoning"] and r["content"] and r["provider"] == "Loopback-int4"
        assert r["generation_id"].startswith("gen-") and r["cost_usd"] > 0
        assert r["usage"]["reasoning_tokens"] > 0 and r["usage"]["cached_tokens"] == 0
        assert r["finish_reason"] == "stop" and r["native_finish_reason"] in ("stop", "tool_calls")
        assert (r["tool_calls"] is not None) == (prompts[r["sample_id"]].tools is not None)
    body = reqs[0]["body"]
    assert body["provider"] == {"quantizations": ["int4"], "ignore": ["fp4-provider"], "allow_fallbacks": False}
    assert body["reasoning"] == {"enabled": True, "exclude": False} and body["max_tokens"] == 24
    for r in reqs:  # tools go out exactly where the prompt has them (every 4th sample id)
        sid = int(r["body"]["messages"][0]["content"].split(":")[0].split()[1])
        assert ("tools" in r["body"]) == (sid % 4 == 0)
    led = assert_adds_up(params)
    d = led["datasets"]["d0"]
    assert d["done"] == 8 and abs(d["cost_usd"] - sum(r["cost_usd"] for r in recs)) < 1e-9
    assert d["by_provider"]["Loopback-int4"]["done"] == 8 and d["by_source"]["api"]["done"] == 8


def test_api_key_never_written_anywhere(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai") as srv:
        srv.faults.extend(["500", "malformed"])
        params = make_params(tmp_path, srv, n=6)
        run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    files = [p for p in params.run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "ledger.json" for p in files) and any(p.suffix == ".jsonl" for p in files)
    for p in files:
        assert KEY.encode() not in p.read_bytes(), p
        assert KEY[-20:].encode() not in p.read_bytes(), p


def test_missing_key_names_the_variable(tmp_path, smollm2_tokenizer, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with LoopbackServer("openai") as srv:
        params = make_params(tmp_path, srv, n=2)
        with pytest.raises(GenerateError, match=KEY_ENV):
            run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        assert not srv.requests


def test_sglang_run_keeps_output_ids_exact(tmp_path, smollm2_tokenizer):
    with LoopbackServer("sglang") as srv:
        params = make_params(tmp_path, srv, n=7, **{"generate.sglang": {"base_url": srv.base_url, "batch_size": 3}})
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        reqs = [r for r in srv.requests if r["path"] == "/generate"]
    assert s.status == "finished" and s.new_records == 7
    sent = {}
    for r in reqs:
        sp = r["body"]["sampling_params"]
        assert sp["skip_special_tokens"] is False and sp["no_stop_trim"] is True and sp["stop_token_ids"] == [2]
        assert sp["max_new_tokens"] == 24
        ids = r["body"]["input_ids"]
        for p in (ids if isinstance(ids[0], list) else [ids]):
            sent[tuple(p)] = True
    assert any(isinstance(r["body"]["input_ids"][0], list) for r in reqs)  # batched
    for r in records(params):
        Record.model_validate(r)
        assert r["source"] == "sglang" and r["ids_exact"] is True and tuple(r["prompt_ids"]) in sent
        assert r["output_ids"][-1] == 2 and r["finish_reason"] == "stop" and r["native_finish_reason"] == "stop:2"
        assert r["usage"]["completion_tokens"] == len(r["output_ids"])
    assert_adds_up(params)


def test_sglang_model_mismatch_refuses_to_start(tmp_path, smollm2_tokenizer):
    with LoopbackServer("sglang", model_path="/models/Qwen3-8B") as srv:
        params = make_params(tmp_path, srv, n=3)
        with pytest.raises(GenerateError, match="Qwen3-8B.*refusing to start"):
            run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        assert not [r for r in srv.requests if r["path"] == "/generate"]
    assert read_ledger(params.run_dir)["status"] == "refused"
    assert records(params) == []


# -- faults --------------------------------------------------------------------------------------

def test_429_waits_retry_after_then_succeeds(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai", retry_after="1") as srv:
        srv.faults.append("429")
        params = make_params(tmp_path, srv, n=1)
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        reqs = [r for r in srv.requests if r["path"] == "/chat/completions"]
    assert s.new_records == 1 and records(params)[0]["finish_reason"] == "stop"
    assert [r["fault"] for r in reqs] == ["429", None]
    assert reqs[1]["t"] - reqs[0]["t"] >= 0.95  # Retry-After: 1


def test_500_is_retried_then_recorded_as_error(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai") as srv:
        srv.faults.extend(["500", "500"])  # recovers on the third try
        params = make_params(tmp_path, srv, n=1)
        run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        assert records(params)[0]["finish_reason"] == "stop"
        srv.always = "500"
        params2 = make_params(tmp_path, srv, n=1, run_name="run2")
        run_generate(params2, progress=False, tokenizer=smollm2_tokenizer)
    (rec,) = records(params2)
    assert rec["finish_reason"] == "error" and "HTTP 500" in rec["error"] and "after 3 attempts" in rec["error"]
    led = assert_adds_up(params2)
    assert led["datasets"]["d0"]["errors"] == 1 and led["datasets"]["d0"]["retries"] == 2


def test_timeout_and_truncated_body_become_error_records(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai", slow_s=1.0) as srv:
        srv.always = "slow"
        params = make_params(tmp_path, srv, n=1, **{"generate.timeout_s": 0.2, "generate.max_retries": 1})
        run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        srv.always = "truncated"
        params2 = make_params(tmp_path, srv, n=1, run_name="run2")
        run_generate(params2, progress=False, tokenizer=smollm2_tokenizer)
    (rec,) = records(params)
    assert rec["finish_reason"] == "error" and "timeout" in rec["error"].lower()
    (rec2,) = records(params2)
    assert rec2["finish_reason"] == "error" and "after 3 attempts" in rec2["error"]


def test_malformed_and_error200_become_error_records(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai") as srv:
        srv.faults.extend(["malformed", "error200"])
        params = make_params(tmp_path, srv, n=3, **{"generate.concurrency": 1})
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    assert s.status == "finished"
    recs = sorted(records(params), key=lambda r: r["created_at"])
    assert [r["finish_reason"] for r in recs] == ["error", "error", "stop"]
    assert "malformed response" in recs[0]["error"]
    assert "provider disconnected" in recs[1]["error"] and recs[1]["cost_usd"] > 0  # billed: kept
    assert_adds_up(params)


def test_content_with_end_of_turn_text_is_kept_verbatim_and_flagged(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai") as srv:
        srv.faults.append("eot")
        params = make_params(tmp_path, srv, n=1)
        run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    (rec,) = records(params)
    assert rec["content"].endswith("<|im_end|>") and rec["flags"] == ["content_has_end_of_turn_text"]
    assert rec["finish_reason"] == "stop"


def test_402_stops_dispatch_and_keeps_completed(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai") as srv:
        srv.faults.extend(["ok", "ok", "ok"])
        srv.always = "402"
        params = make_params(tmp_path, srv, n=10, **{"generate.concurrency": 1})
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        n_req = len([r for r in srv.requests if r["path"] == "/chat/completions"])
    assert s.status == "stopped" and "402" in s.stop_reason
    assert n_req == 4  # no request after the 402
    recs = records(params)
    assert len(recs) == 3 and all(r["finish_reason"] == "stop" for r in recs)
    led = assert_adds_up(params)
    assert led["datasets"]["d0"]["skipped"] == 7 and "402" in led["stop_reason"]


@pytest.mark.parametrize("fault, words", [("401", "key refused"), ("404", "provider routing")])
def test_key_refused_or_no_endpoint_stops_dispatch(tmp_path, smollm2_tokenizer, fault, words):
    """Answers every later request would repeat stop the run at once instead of writing an error per sample."""
    with LoopbackServer("openai") as srv:
        srv.faults.extend(["ok", "ok"])
        srv.always = fault
        params = make_params(tmp_path, srv, n=8, **{"generate.concurrency": 1})
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        n_req = len([r for r in srv.requests if r["path"] == "/chat/completions"])
    assert s.status == "stopped" and f"HTTP {fault}" in s.stop_reason and words in s.stop_reason
    assert n_req == 3
    assert len(records(params)) == 2  # the error is in the ledger, not journaled per sample
    led = assert_adds_up(params)
    assert led["datasets"]["d0"]["skipped"] == 6


def test_credit_below_cost_cap_refuses_to_start(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai", credit=1.0) as srv:
        params = make_params(tmp_path, srv, n=2, **{"generate.cost_cap_usd": 5.0})
        with pytest.raises(GenerateError, match="below"):
            run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        assert not [r for r in srv.requests if r["path"] == "/chat/completions"]


# -- budgets -------------------------------------------------------------------------------------

def test_token_budget_holds_within_in_flight_bound(tmp_path, smollm2_tokenizer):
    budget, conc = 3000, 3
    with LoopbackServer("openai", latency=0.005) as srv:
        params = make_params(tmp_path, srv, n=60, datasets=2, **{
            "generate.concurrency": conc, "generate.reserve_completion_tokens": 50})
        params.datasets[0].token_budget = budget
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    led = assert_adds_up(params)
    d0, d1 = led["datasets"]["d0"], led["datasets"]["d1"]
    recs = records(params)
    used = sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in recs)
    biggest = max(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in recs)
    assert d0["budget_reached"] and d0["skipped"] > 0 and budget <= used <= budget + conc * biggest
    assert d1["done"] == 60 and not d1["budget_reached"]  # the other dataset is not cut
    done_ids = sorted(r["sample_id"] for r in recs)
    assert done_ids != list(range(len(done_ids)))  # seeded shuffle: not the head of the file
    assert s.status == "finished"


def test_cost_cap_holds_within_in_flight_bound(tmp_path, smollm2_tokenizer):
    cap, conc = 0.002, 2
    with LoopbackServer("openai", price_per_token=1e-5) as srv:
        params = make_params(tmp_path, srv, n=40, **{"generate.concurrency": conc, "generate.cost_cap_usd": cap})
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    recs = records(params)
    spent = sum(r["cost_usd"] for r in recs)
    assert s.status == "stopped" and "cost cap" in s.stop_reason
    assert cap <= spent <= cap + conc * max(r["cost_usd"] for r in recs)
    assert_adds_up(params)


# -- resume, stop, kill --------------------------------------------------------------------------

def test_resume_skips_done_and_retries_errors_when_asked(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai") as srv:
        srv.faults.extend(["malformed", "malformed"])
        params = make_params(tmp_path, srv, n=6, **{"generate.concurrency": 1})
        run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        s2 = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)  # errors stay errors
        assert s2.new_records == 0
        params3 = make_params(tmp_path, srv, n=6, **{"generate.retry_errors": True})
        s3 = run_generate(params3, progress=False, tokenizer=smollm2_tokenizer)
    assert s3.new_records == 2
    recs = records(params)
    ok = [r for r in recs if r["finish_reason"] == "stop"]
    assert len(recs) == 8 and sorted(r["sample_id"] for r in ok) == list(range(6))
    led = assert_adds_up(params3)
    assert led["datasets"]["d0"]["done"] == 6 and led["datasets"]["d0"]["errors"] == 0


def test_stop_file_stops_gracefully(tmp_path, smollm2_tokenizer):
    with LoopbackServer("openai", latency=0.05) as srv:
        params = make_params(tmp_path, srv, n=200, **{"generate.concurrency": 2})
        stop = params.run_dir / "STOP"

        def touch():
            while len(srv.requests) < 6:
                time.sleep(0.01)
            stop.write_text("stop")

        t = threading.Thread(target=touch)
        t.start()
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        t.join()
    assert s.status == "stopped" and "STOP file" in s.stop_reason
    led = assert_adds_up(params)
    assert led["datasets"]["d0"]["skipped"] > 100 and led["datasets"]["d0"]["cancelled"] == 0
    assert led["status"] == "stopped"


def test_runs_inside_a_running_event_loop(tmp_path, smollm2_tokenizer):
    """A notebook cell runs inside the kernel's loop: run_generate must still work (nest_asyncio), and leave
    no task of its own pending on that loop (the kernel's loop outlives the run: its ticker was left behind)."""
    with LoopbackServer("openai") as srv:
        params = make_params(tmp_path, srv, n=3)

        async def cell():
            s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
            return s, [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]

        s, left = asyncio.run(cell())
    assert s.status == "finished" and s.new_records == 3
    assert left == []


def _spawn(params_file: Path, overrides: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "eagle3data", "generate", str(params_file), "--quiet"]
    for k, v in overrides.items():
        cmd += ["-p", k, orjson.dumps(v).decode() if not isinstance(v, str) else v]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _sub_overrides(tmp_path: Path, srv: LoopbackServer, n: int, **extra) -> dict:
    p = write_prompts(tmp_path / "prompts_0.jsonl", n)
    o = {"output_root": str(tmp_path / "out"), "run_name": "run", "datasets": [{"name": "d0", "path": str(p)}],
         "generate.backend": "openai", "generate.concurrency": 6, "generate.timeout_s": 10,
         "generate.ledger_interval_s": 0.05,
         "generate.openai": {"base_url": srv.base_url, "model": "m", "api_key_env": KEY_ENV}}
    o.update(extra)
    return o


def _wait_lines(path: Path, n: int, proc: subprocess.Popen) -> None:
    while not path.exists() or path.read_bytes().count(b"\n") < n:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.02)


def test_sigkill_mid_flight_then_resume_gives_each_sample_once(tmp_path, smollm2_tokenizer):
    n = 60
    with LoopbackServer("openai", latency=0.05, jitter=0.3) as srv:
        o = _sub_overrides(tmp_path, srv, n)
        proc = _spawn(REPO / "params" / "ci.yaml", o)
        journal = tmp_path / "out" / "run" / "records" / "d0.jsonl"
        _wait_lines(journal, 10, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_at = journal.read_bytes().count(b"\n")
        assert killed_at < n
        with open(journal, "ab") as f:  # what a write cut by the kill leaves behind
            f.write(b'{"dataset": "d0", "sample_id": 9')
        params = load_params(REPO / "params" / "ci.yaml", o)
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    assert s.torn_tail_bytes == {"d0": len(b'{"dataset": "d0", "sample_id": 9')}
    data = journal.read_bytes()
    assert data.endswith(b"\n")
    lines = data.splitlines()
    ids = [orjson.loads(line)["sample_id"] for line in lines]  # every line parses
    assert sorted(ids) == list(range(n))  # every sample exactly once
    assert s.new_records == n - killed_at
    led = assert_adds_up(params)
    assert led["datasets"]["d0"]["resumed"] == killed_at and led["torn_tail_bytes_repaired"] == {"d0": 32}


def test_sigint_graceful_then_second_sigint_cancels(tmp_path):
    n = 200
    with LoopbackServer("openai", latency=0.4, jitter=0.2) as srv:
        o = _sub_overrides(tmp_path, srv, n, **{"generate.stop_grace_s": 60})
        proc = _spawn(REPO / "params" / "ci.yaml", o)
        journal = tmp_path / "out" / "run" / "records" / "d0.jsonl"
        _wait_lines(journal, 6, proc)
        proc.send_signal(signal.SIGINT)
        # the ledger says it is stopping; then a second signal cancels what is in flight
        ledger = tmp_path / "out" / "run" / "ledger.json"
        while b'"stopping"' not in ledger.read_bytes():
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate()
    assert proc.returncode == 3, err.decode()
    params = load_params(REPO / "params" / "ci.yaml", o)
    led = assert_adds_up(params)
    d = led["datasets"]["d0"]
    assert led["status"] == "cancelled" and "SIGINT" in led["stop_reason"]
    assert d["cancelled"] > 0 and d["skipped"] > 0 and d["done"] == len(records(params))
    assert not set(d["cancelled_ids"]) & {r["sample_id"] for r in records(params)}


def test_sigint_waits_for_in_flight(tmp_path):
    with LoopbackServer("openai", latency=0.3) as srv:
        o = _sub_overrides(tmp_path, srv, 100, **{"generate.concurrency": 4})
        proc = _spawn(REPO / "params" / "ci.yaml", o)
        journal = tmp_path / "out" / "run" / "records" / "d0.jsonl"
        _wait_lines(journal, 4, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate()
        sent = len([r for r in srv.requests if r["path"] == "/chat/completions"])
    assert proc.returncode == 3, err.decode()
    params = load_params(REPO / "params" / "ci.yaml", o)
    led = assert_adds_up(params)
    d = led["datasets"]["d0"]
    assert led["status"] == "stopped" and d["cancelled"] == 0
    assert d["done"] == sent == len(records(params))  # everything sent was waited for and kept


@pytest.mark.parametrize("kind", ["openai", "sglang"])
def test_prompts_templated_at_dispatch_too_long_rejected_never_sent(tmp_path, smollm2_tokenizer, kind):
    """HTTP runs template each prompt as it is dispatched (or ahead, while every slot is busy):
    ids match template_prompt, and a prompt reaching model.max_context is skipped, listed, never sent."""
    from eagle3data.core.profiles import SMOLLM2
    from eagle3data.prompts.load import load_prompts, template_prompt

    prompts = load_prompts(write_prompts(tmp_path / "probe.jsonl", 12)).prompts
    lengths = {p.sample_id: len(template_prompt(smollm2_tokenizer, p, SMOLLM2)) for p in prompts}
    max_ctx = sorted(set(lengths.values()))[-2]  # the longest prompts (and any as long as the runner-up) reach it
    too_long = {sid for sid, n in lengths.items() if n >= max_ctx}
    assert 0 < len(too_long) < len(prompts)
    with LoopbackServer(kind, latency=0.05) as srv:
        params = make_params(tmp_path, srv, n=12, **{"generate.concurrency": 2, "model.max_context": max_ctx})
        s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
        reqs = [r for r in srv.requests if r["path"] in ("/chat/completions", "/generate")]
    assert s.status == "finished"
    recs = records(params)
    by_id = {p.sample_id: p for p in load_prompts(params.datasets[0].path).prompts}
    assert {r["sample_id"] for r in recs} == set(lengths) - too_long
    for r in recs:
        assert r["prompt_ids"] == template_prompt(smollm2_tokenizer, by_id[r["sample_id"]], SMOLLM2)
    assert len(reqs) == len(prompts) - len(too_long)
    d = assert_adds_up(params)["datasets"]["d0"]
    assert d["skipped"] == len(too_long) and set(d["skipped_ids"]) == too_long
    assert len(d["rejected_prompt_lines"]) == len(too_long)
    assert all("model.max_context" in line for line in d["rejected_prompt_lines"])
