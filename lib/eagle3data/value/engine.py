"""Engine τ: the target served by vLLM with and without the draft, on the evaluation prompts, greedy.

The project starts and stops each server itself (`generate/backends/vllm_server.py`, as 01 and 04
do). The plain server gives the reference continuations (the target's greedy ids); the speculative
one (`--speculative-config {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}`) gives,
per prompt, vLLM's own per-request acceptance metrics (`--per-request-spec-decode-metrics detailed`:
verification steps, accepted drafts, the accepted count of every step) and its ids, which must equal
the plain greedy ids for every prompt (speculation is lossless: a difference is a fault in the draft,
its config or vocabulary map, and fails the stage). The pooled figure is cross-checked against the
server's Prometheus counters (`vllm:spec_decode_num_drafts`, `..._num_accepted_tokens`): the sum of
the per-request figures must equal the counters' increase over the evaluation.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from eagle3data.core.errors import UserInputError
from eagle3data.core.params import VLLMParams
from eagle3data.generate.backends.vllm_server import VLLMServer, server_command
from eagle3data.value.train import ValueStopped

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


class EngineEvalError(UserInputError):
    """The engine evaluation failed (a server, a reply, or a speculative output that differs from greedy)."""


class EvalStopped(ValueStopped):
    """A stop during an engine evaluation: the servers are stopped; the evaluation starts over when run again."""


@dataclass
class Served:
    ids: list[int]
    finish: str | None
    steps: int | None = None              # verification steps (drafts)
    accepted: int | None = None           # accepted draft tokens
    per_step: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.steps if self.steps else None


def read_counters(base_url: str) -> dict[str, float]:
    """The spec-decode counters of a vLLM server's /metrics (Prometheus text; `_total` names, summed over labels)."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    out = {c: 0.0 for c in COUNTERS}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _complete(client: httpx.Client, base_url: str, model: str, ids: list[int], max_new_tokens: int) -> Served:
    body = {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0,
            "return_token_ids": True}
    t0 = time.monotonic()
    r = client.post(base_url + "/completions", json=body)
    if r.status_code != 200:
        raise EngineEvalError(f"{base_url}/completions: HTTP {r.status_code}: {r.text[:200]}")
    obj = r.json()
    ch = obj["choices"][0]
    spec = ((obj.get("metrics") or {}).get("speculative_decoding") or {})
    return Served(list(ch["token_ids"]), ch.get("finish_reason"), spec.get("num_spec_steps"),
                  spec.get("num_accepted_draft_tokens"), list(spec.get("per_step_accepted") or []),
                  round(time.monotonic() - t0, 3))


def serve(params: Any, server: Any, prompts: Sequence[list[int]], max_new_tokens: int, *, stage: str,
          draft_dir: Path | None = None, k: int = 3, concurrency: int = 8,
          say: Callable[[str], None] = print,
          stop: Callable[[], bool] | None = None) -> tuple[list[Served], dict[str, Any]]:
    """Start a server (plain, or with the draft), send every prompt (greedy), stop it; replies in prompt order.
    `stop()` true (the run's STOP file) or Ctrl-C: nothing more is sent, EvalStopped raised."""

    extra = []
    if draft_dir is not None:
        spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
        extra = ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed"]
    v = VLLMParams(launch=True, server=server)
    cmd = server_command(params, v, stage=stage, extra_args=extra)
    t0 = time.monotonic()
    with VLLMServer(cmd, progress=False) as srv:
        started = srv.started_s
        before = read_counters(srv.base_url) if draft_dir is not None else {}
        out: list[Served | None] = [None] * len(prompts)
        done = 0
        t1 = time.monotonic()
        pool = ThreadPoolExecutor(concurrency)
        try:
            with httpx.Client(timeout=httpx.Timeout(1800.0)) as client:
                futs = {pool.submit(_complete, client, srv.base_url, params.model.name, p, max_new_tokens): i
                        for i, p in enumerate(prompts)}
                last = 0.0
                for f in futs:
                    while out[futs[f]] is None:
                        if stop is not None and stop():
                            raise EvalStopped(f"{stage}: stopped after {done:,} of {len(prompts):,} prompts "
                                              "(an evaluation is not resumed: it starts over)")
                        try:
                            out[futs[f]] = f.result(timeout=1.0)
                        except FuturesTimeout:
                            pass
                    done += 1
                    if time.monotonic() - last > 10 or done == len(prompts):
                        last = time.monotonic()
                        say(f"{stage}: {done}/{len(prompts)} prompts · {time.monotonic() - t1:.0f} s")
        except KeyboardInterrupt:
            raise EvalStopped(f"{stage}: interrupted after {done:,} of {len(prompts):,} prompts (an evaluation is "
                              "not resumed: it starts over)") from None
        finally:  # on a stop or an error nothing more is sent; the server stops with what is in flight
            pool.shutdown(wait=False, cancel_futures=True)
        serve_s = time.monotonic() - t1
        after = read_counters(srv.base_url) if draft_dir is not None else {}
    counters = {c.split(":", 1)[1]: after[c] - before[c] for c in after}
    return out, {"start_s": started, "serve_s": round(serve_s, 1), "total_s": round(time.monotonic() - t0, 1),
                 "counters": counters}
