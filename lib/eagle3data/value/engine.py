"""Engine τ: the target served by vLLM with and without the draft, on the evaluation prompts, at one or more
sampling temperatures T ≥ 0 (greedy at T = 0).

The project starts and stops each server itself (`generate/backends/vllm_server.py`, as 01 and 04
do). The plain server gives the reference continuations (the target's greedy ids); the speculative
one (`--speculative-config {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}`) gives,
per prompt, vLLM's own per-request acceptance metrics (`--per-request-spec-decode-metrics detailed`:
verification steps, accepted drafts, the accepted count of every step) and its ids. `serve_temperatures`
starts the server once and sends every prompt once per temperature (one pass after the other). The pooled
figure of each pass is cross-checked against the server's Prometheus counters (`vllm:spec_decode_num_drafts`,
`..._num_accepted_tokens`), read before and after that pass: the sum of the pass's per-request figures must
equal the counters' increase over it.

**T = 0** (greedy requests): speculation is lossless token for token, so the speculative ids must equal the plain
greedy ids for every prompt (a difference is a fault in the draft, its config or vocabulary map, and fails the
stage). **T > 0**: each request carries `temperature: T` and its own `seed` (`request_seed`: from the run's seed,
T and the prompt's index), so the target's sampler and vLLM's rejection sampler draw from a per-request generator
and a pass is reproducible. Speculative sampling is then lossless *in distribution* only: the ids are a sample
of the target's tempered distribution, not those of a plain server given the same seed (the random draws are
consumed differently), so the per-prompt ids check applies at T = 0 only.

**What vLLM (0.32) does at T > 0**, which is what `value/sampling.py` models (`draft_temperature=0`):
- the EAGLE proposer drafts greedily: `SpeculativeConfig.draft_sample_method` defaults to `"greedy"`
  (`vllm/config/speculative.py`), under which `SpecDecodeBaseProposer._sample_draft_tokens`
  (`vllm/v1/spec_decode/llm_base_proposer.py`) takes `_greedy_sample`, the argmax of the draft's logits, and
  returns no draft probabilities (`None`); the argmax is over the target's vocabulary after
  `Eagle3LlamaForCausalLM.compute_logits` (`vllm/model_executor/models/llama_eagle3.py`) scatters the draft's
  logits through d2t with −inf elsewhere, i.e. the draft's own argmax mapped by d2t. (`"probabilistic"` would
  sample the draft at T and keep its probs; not used here, and refused with a heterogeneous vocabulary.)
- the rejection sampler (`vllm/v1/sample/rejection_sampler.py`: `RejectionSampler.forward` →
  `apply_sampling_constraints` divides the target's logits by T (then top-k/top-p, none here:
  `--generation-config vllm`) → `rejection_sample` → `rejection_random_sample_kernel`) with
  `NO_DRAFT_PROBS` takes draft_prob = 1, so a draft token x is accepted iff `p_T(x) ≥ u`, u uniform from the
  request's generator: with probability p_T(x) — min(1, p/q) with q a point mass on x. On a rejection the
  token is drawn from p_T with x masked out (`sample_recovered_tokens_kernel`), i.e. norm(max(0, p − δ_x)):
  the output is distributed as p_T.

**vLLM's CPU build (0.32) at T > 0 needs two fixes, applied here** (`generate/backends/vllm_cpu_fixes.py`, also for 01's servers at T > 0):
1. Without triton-cpu (this project's `.engine/`), vLLM swaps its Triton kernels for C++ shims
   (`CpuPlatform.register_triton_kernel_overrides`, `vllm/platforms/cpu.py`). The `expand_kernel` shim
   (`_expand_kernel_impl`, `vllm/utils/cpu_triton_utils.py`) runs the int64 C++ kernel on an int64 *copy* of its
   float output and never writes the caller's buffer, so `expand_batch_to_tokens` hands the rejection sampler
   uninitialised memory as the per-token temperature (and top-k/top-p): a speculative server at T > 0 samples noise,
   accepts almost nothing and a seeded request does not repeat (vllm-project/vllm#55005, fix proposed in #55006;
   greedy requests never call it). The plugin replaces the shim by a dtype-preserving `repeat_interleave` (#55006's
   semantics; nothing changes where Triton runs).
2. A seeded request whose prefill is chunked (long prompts in flight together) has its partial step's sample
   discarded, and `GPUModelRunner._bookkeeping_sync` (`vllm/v1/worker/gpu_model_runner.py`) rewinds the request's
   generator with `set_offset`, which a CPU generator lacks: "CPU Generator does not use offset" kills the engine.
   The plugin saves such a request's CPU generator state before `_sample` and restores it instead (the same
   rewind, exact; CUDA generators are left to vLLM).
A server with a T > 0 pass starts with the plugin on its PYTHONPATH (a vLLM general plugin, entry point
`vllm.general_plugins`, loaded in every vLLM process before the worker registers its shims); it writes a mark
file, and a server started without the mark is refused (EngineEvalError). Servers with T = 0 passes only are
started exactly as before.
"""

from __future__ import annotations

import hashlib
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
from eagle3data.generate.backends.vllm_server import (ServerError, VLLMServer, check_cpu_fixes, server_command,
                                                     with_cpu_fixes)
from eagle3data.value.sampling import temperature_key
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


def request_seed(seed: int, temperature: float, index: int) -> int:
    """The `seed` of prompt `index`'s request at `temperature` (> 0) in a pass seeded `seed`: a base from sha256 of
    (seed, T) plus the index, below 2**31 — reproducible across processes, distinct for every prompt of a pass."""
    base = int.from_bytes(hashlib.sha256(f"{int(seed)}:{temperature_key(temperature)}".encode()).digest()[:4], "big")
    return (base + index) % 2**31


def _complete(client: httpx.Client, base_url: str, model: str, ids: list[int], max_new_tokens: int,
              temperature: float = 0.0, seed: int | None = None) -> Served:
    body = {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": float(temperature),
            "return_token_ids": True}
    if temperature > 0:  # the plain tempered softmax (no top-k/top-p), a per-request generator
        body |= {"top_p": 1.0, "top_k": 0, "seed": seed}
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


def _one_pass(srv: Any, model: str, prompts: Sequence[list[int]], max_new_tokens: int, temperature: float,
              seed: int, *, label: str, concurrency: int, say: Callable[[str], None],
              stop: Callable[[], bool] | None) -> list[Served]:
    out: list[Served | None] = [None] * len(prompts)
    done = 0
    t1 = time.monotonic()
    pool = ThreadPoolExecutor(concurrency)
    try:
        with httpx.Client(timeout=httpx.Timeout(1800.0)) as client:
            futs = {pool.submit(_complete, client, srv.base_url, model, p, max_new_tokens, temperature,
                                request_seed(seed, temperature, i) if temperature > 0 else None): i
                    for i, p in enumerate(prompts)}
            last = 0.0
            for f in futs:
                while out[futs[f]] is None:
                    if stop is not None and stop():
                        raise EvalStopped(f"{label}: stopped after {done:,} of {len(prompts):,} prompts "
                                          "(an evaluation is not resumed: it starts over)")
                    try:
                        out[futs[f]] = f.result(timeout=1.0)
                    except FuturesTimeout:
                        pass
                done += 1
                if time.monotonic() - last > 10 or done == len(prompts):
                    last = time.monotonic()
                    say(f"{label}: {done}/{len(prompts)} prompts · {time.monotonic() - t1:.0f} s")
    except KeyboardInterrupt:
        raise EvalStopped(f"{label}: interrupted after {done:,} of {len(prompts):,} prompts (an evaluation is "
                          "not resumed: it starts over)") from None
    finally:  # on a stop or an error nothing more is sent; the server stops with what is in flight
        pool.shutdown(wait=False, cancel_futures=True)
    return out  # type: ignore[return-value]


def serve_temperatures(params: Any, server: Any, prompts: Sequence[list[int]], max_new_tokens: int, *, stage: str,
                       draft_dir: Path | None = None, k: int = 3, concurrency: int = 8,
                       say: Callable[[str], None] = print, stop: Callable[[], bool] | None = None,
                       temperatures: Sequence[float] = (0.0,),
                       seed: int = 0) -> tuple[dict[float, list[Served]], dict[str, Any]]:
    """Start a server (plain, or with the draft) once, send every prompt once per temperature (in the order given;
    greedy at T = 0, `temperature: T` and `request_seed(seed, T, i)` at T > 0), stop it. Returns
    {T: replies in prompt order} and info: `start_s`, `total_s`, `serve_s` and `counters` (the first temperature's
    pass: the counters' increase over it, as `serve` gives), and `by_temperature` {temperature_key(T): {serve_s,
    counters}} (each pass's own increase; /metrics read before and after each pass; empty counters for a plain
    server). `stop()` true (the run's STOP file) or Ctrl-C: nothing more is sent, EvalStopped raised."""

    temps = [float(t) for t in temperatures]
    if not temps or any(t < 0 for t in temps) or len(set(temps)) != len(temps):
        raise EngineEvalError(f"{stage}: temperatures must be distinct and ≥ 0, at least one: {list(temperatures)}")
    extra = []
    if draft_dir is not None:
        spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
        extra = ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed"]
    v = VLLMParams(launch=True, server=server)
    fix = any(t > 0 for t in temps)  # vLLM's CPU build at T > 0 (module docstring)
    cmd = server_command(params, v, stage=stage, extra_args=extra)
    mark = with_cpu_fixes(cmd, params.run_dir, stage) if fix else None
    t0 = time.monotonic()
    served: dict[float, list[Served]] = {}
    by_t: dict[str, Any] = {}
    with VLLMServer(cmd, progress=False) as srv:
        started = srv.started_s
        if mark is not None:
            try:
                check_cpu_fixes(mark, stage)
            except ServerError as e:
                raise EngineEvalError(str(e)) from None
        for T in temps:
            before = read_counters(srv.base_url) if draft_dir is not None else {}
            t1 = time.monotonic()
            served[T] = _one_pass(srv, params.model.name, prompts, max_new_tokens, T, seed,
                                  label=f"{stage} T={T:g}", concurrency=concurrency, say=say, stop=stop)
            serve_s = time.monotonic() - t1
            after = read_counters(srv.base_url) if draft_dir is not None else {}
            by_t[temperature_key(T)] = {"serve_s": round(serve_s, 1),
                                        "counters": {c.split(":", 1)[1]: after[c] - before[c] for c in after}}
    first = by_t[temperature_key(temps[0])]
    return served, {"start_s": started, "serve_s": first["serve_s"], "total_s": round(time.monotonic() - t0, 1),
                    "counters": first["counters"], "by_temperature": by_t}


def serve(params: Any, server: Any, prompts: Sequence[list[int]], max_new_tokens: int, *, stage: str,
          draft_dir: Path | None = None, k: int = 3, concurrency: int = 8,
          say: Callable[[str], None] = print,
          stop: Callable[[], bool] | None = None) -> tuple[list[Served], dict[str, Any]]:
    """Start a server (plain, or with the draft), send every prompt (greedy), stop it; replies in prompt order.
    `stop()` true (the run's STOP file) or Ctrl-C: nothing more is sent, EvalStopped raised. (`serve_temperatures`
    at T = 0 alone.)"""

    served, info = serve_temperatures(params, server, prompts, max_new_tokens, stage=stage, draft_dir=draft_dir, k=k,
                                      concurrency=concurrency, say=say, stop=stop, temperatures=(0.0,))
    return served[0.0], info
