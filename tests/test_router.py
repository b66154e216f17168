"""Many SGLang servers behind the real `sglang-router` (PyPI, a Rust binary on the CPU), as docs/01 advises.

Two SGLang-shaped loopback workers (tests/loopback.py, each its own process, answering
`/health`, `/get_model_info` and `/generate`, their response ids prefixed w0-/w1-) sit behind
the router; 01 runs through the router. Exact ids are journaled from both workers; one worker
is SIGKILLed mid-run: what it had in flight is retried (by the router, or by the engine when
the router answers 5xx) and every sample ends up journaled exactly once, none an error.
Skipped only where the router is not installed (it is in the `test` extra).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install sglang-router: the `test` extra has it)")

sys.path.insert(0, str(Path(__file__).parent))
from runfiles import assert_ledger_adds_up  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(prefix: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "loopback.py"), "--kind", "sglang",
                             "--latency", "0.15", "--jitter", "0.3", "--id-prefix", prefix],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, tries: int = 300) -> None:
    for _ in range(tries):  # bounded: about 60 s at most
        assert proc.poll() is None, f"router exited: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"router at {url} never became healthy: {log.read_text()[-2000:]}")


@pytest.fixture
def router(tmp_path):
    """(router URL, [worker processes]) with two workers; every process is ended afterwards."""
    procs = []
    try:
        w0, u0 = _worker("w0")
        procs.append(w0)
        w1, u1 = _worker("w1")
        procs.append(w1)
        port = _free_port()
        log = tmp_path / "router.log"
        with open(log, "w") as f:
            r = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                  "--port", str(port), "--worker-urls", u0, u1, "--policy", "round_robin",
                                  "--log-level", "warn", "--health-check-interval-secs", "1",
                                  "--worker-startup-timeout-secs", "30"],
                                 stdout=f, stderr=subprocess.STDOUT)
        procs.append(r)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, r, log)
        yield url, [w0, w1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_two_workers_behind_the_router_one_killed_nothing_lost_or_duplicated(tmp_path, router, smollm2_tokenizer):
    import orjson

    from eagle3data.generate.run import run_generate
    from eagle3data.core.params import load_params
    from eagle3data.core.records import Record, scan_journal

    url, (w0, w1) = router
    n = 80
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b"".join(orjson.dumps({"sample_id": i, "messages": [
        {"role": "user", "content": f"Question {i}: " + "what follows? " * (1 + i % 7)}]}) + b"\n" for i in range(n)))
    params = load_params(REPO / "params" / "ci.yaml", {
        "output_root": str(tmp_path / "out"), "run_name": "run", "datasets": [{"name": "d0", "path": str(prompts)}],
        "generate.backend": "sglang", "generate.sglang": {"base_url": url},
        "generate.concurrency": 8, "generate.timeout_s": 30, "generate.max_retries": 8,
        "generate.retry_backoff_s": 0.05, "generate.retry_backoff_max_s": 0.5, "generate.ledger_interval_s": 0.05})
    journal = params.run_dir / "records" / "d0.jsonl"
    killed_after: list[int] = []

    def kill_one() -> None:  # SIGKILL worker 1 once a quarter of the samples is journaled
        for _ in range(6000):  # bounded
            if journal.exists() and journal.read_bytes().count(b"\n") >= n // 4:
                break
            time.sleep(0.01)
        killed_after.append(journal.read_bytes().count(b"\n") if journal.exists() else 0)
        os.kill(w1.pid, signal.SIGKILL)

    t = threading.Thread(target=kill_one)
    t.start()
    s = run_generate(params, progress=False, tokenizer=smollm2_tokenizer)
    t.join()
    assert w1.wait() == -signal.SIGKILL and w0.poll() is None
    assert s.status == "finished"
    recs = scan_journal(journal).records
    assert sorted(r["sample_id"] for r in recs) == list(range(n))  # every sample exactly once
    assert all(r["finish_reason"] == "stop" for r in recs)  # none became an error
    workers = {r["generation_id"].split("-")[0] for r in recs}
    assert workers == {"w0", "w1"}  # exact ids from both workers
    for r in recs:
        Record.model_validate(r)
        p = r["prompt_ids"]
        k = 3 + (len(p) + sum(p[-3:])) % 13  # what the loopback worker samples for this prompt
        assert r["source"] == "sglang" and r["ids_exact"]
        assert r["output_ids"] == [100 + (len(p) * 7 + i * 31) % 4000 for i in range(k)] + [2]
    # after the kill, only worker 0 answers: the last records all come from it
    late = sorted(recs, key=lambda r: r["created_at"])[killed_after[0] + 8:]
    assert late and {r["generation_id"].split("-")[0] for r in late} == {"w0"}
    led = assert_ledger_adds_up(params.run_dir)
    assert led["datasets"]["d0"]["done"] == n and led["datasets"]["d0"]["errors"] == 0
