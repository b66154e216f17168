"""06 stops when asked: the engine evaluation sends nothing more once the run's STOP file appears (or on Ctrl-C) and
raises EvalStopped at once, instead of waiting for every prompt already queued; `eagle3data run` reports a 06 that
stopped itself as stopped (exit 3, the resume command), not as failed."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

import eagle3data.value.engine as E
from eagle3data.core.params import VLLMServerParams
from eagle3data.headless import _stage_outcome


class _Params:
    class model:  # noqa: N801 - the shape serve reads
        name = "m"


@contextmanager
def _no_server(*a, **k):
    class S:
        started_s, base_url = 0.0, "http://127.0.0.1:9/v1"
    yield S()


def test_the_engine_evaluation_stops_on_request_without_draining_its_queue(monkeypatch, tmp_path):
    sent: list[int] = []
    lock = threading.Lock()

    def slow(client, url, model, ids, n, temperature=0.0, seed=None):
        with lock:
            sent.append(ids[0])
        time.sleep(0.3)
        return E.Served(list(ids), "length")

    monkeypatch.setattr(E, "VLLMServer", _no_server)
    monkeypatch.setattr(E, "server_command", lambda *a, **k: [])
    monkeypatch.setattr(E, "_complete", slow)
    stop_file = tmp_path / "STOP"
    threading.Timer(0.5, stop_file.touch).start()
    t0 = time.monotonic()
    with pytest.raises(E.EvalStopped, match=r"06_exact T=0: stopped after \d+ of 200 prompts"):
        E.serve(_Params(), VLLMServerParams(port=0), [[i] for i in range(200)], 4, stage="06_exact", concurrency=4,
                say=lambda s: None, stop=stop_file.exists)
    assert time.monotonic() - t0 < 5  # 200 prompts at 4 in flight would take 15 s
    time.sleep(0.5)
    assert len(sent) < 40, len(sent)  # what was in flight finished; the queue was dropped


def test_a_stopped_06_is_reported_as_stopped_with_what_it_kept(tmp_path):
    status, kept = _stage_outcome(tmp_path, "06_value")
    assert status == "stopped" and "checkpoint kept" in kept
