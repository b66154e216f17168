"""Stage 01: run prompt datasets through the target and journal every response as it completes.

`run_generate(params)` templates every prompt with the profile's options, skips samples the
journal already holds (resume keyed by `(dataset, sample_id)`; a torn last line is cut off
and reported), and generates with the backend named in params:

- `local`: in-process generation, continuous batching; exact ids. A slot that frees is filled with
  the next prompt that is sent (one a budget skips leaves its place to the next). A first
  SIGINT/SIGTERM or a `STOP` file stops admitting prompts and journals the rows in flight; a second
  signal drops them.
- `sglang`: the native `/generate` endpoint with pre-templated `input_ids`; exact ids.
- `vllm`: vLLM's `/v1/completions` with pre-templated token-id prompts and `return_token_ids`;
  exact ids.
- `openai`: an OpenAI-compatible `/chat/completions` API (OpenRouter flavour); text records,
  ids rebuilt by 02_reconstruct.

The HTTP backends share one asyncio engine (`backends/engine.py`) with budgets, a cost cap,
retries and a graceful stop (SIGINT/SIGTERM, or a `STOP` file in the run folder; a second
signal cancels what is in flight). `outputs/<run>/ledger.json` is kept current while it runs.
Headless without papermill: `python -m eagle3data generate params/x.yaml -p key value`.

`generate.turns: all` (or `datasets[].turns`) regenerates each conversation turn by turn, every
turn from the model's own earlier replies (`turns.py`; one record per turn, keyed
`dataset/sample_id#turn`; docs/01 "Turns"). Both the local loop and the HTTP engine run a
conversation's turns in order and conversations concurrently; resume replays the journaled turns.

Where each part lives: the plan (what to send, resume by key, each conversation's next turn) in
`plan.py`, the local loop (continuous batching) in `local.py`, the SIGINT/SIGTERM routing in `signals.py`; this
module runs them: the HTTP engine's set-up and hooks, asyncio from plain Python or a notebook's
running loop, the garbage collector kept off what lives as long as the run, the summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import nest_asyncio

from eagle3data.core.models import tokenizer_for
from eagle3data.core.params import RunParams
from eagle3data.core.profiles import get_profile
from eagle3data.core.provenance import write_provenance
from eagle3data.core.runlock import hold_run
from eagle3data.generate.backends.engine import Engine, EngineSettings, GenerateError, Job
from eagle3data.generate.backends.openai_api import OpenAIBackend
from eagle3data.generate.backends.sglang import SGLangBackend
from eagle3data.generate.backends.sglang_server import SGLangServer, sglang_command
from eagle3data.generate.backends.vllm import VLLMBackend
from eagle3data.generate.backends.vllm_server import VLLMServer, check_cpu_fixes, server_command, with_cpu_fixes
from eagle3data.generate.ledger import DatasetLedger, ledger_frame, provider_frame, write_ledger
from eagle3data.generate.local import _run_local
from eagle3data.generate.plan import RunPlan, _report_resume, _take_turn, _too_long, plan_run
from eagle3data.generate.signals import _stop_signals
from eagle3data.prompts.load import check_dataset_files, template_prompts

# Set by `eagle3data run` for the kernel it starts: a STOP file there is that run's own stop request
# (written on Ctrl-C before this stage got going), never a stale one to remove.
CLI_RUN_ENV = "EAGLE3DATA_CLI_RUN"


@dataclass
class GenerateSummary:
    """What a call of run_generate did: the ledger, time, new records, and how it ended."""

    run_dir: Path
    ledger: dict[str, DatasetLedger]
    seconds: float
    new_records: int
    status: str = "finished"
    stop_reason: str | None = None
    torn_tail_bytes: dict[str, int] = field(default_factory=dict)
    responses: int = 0
    engine_seconds: float = 0.0
    engine_cpu_s: float = 0.0

    def table(self):
        """One row per dataset: planned, done, resumed, errors, skipped, cancelled, tokens, cost."""
        return ledger_frame(self.ledger)

    def providers(self):
        """One row per dataset and source/provider: done, errors, tokens, cost."""
        return provider_frame(self.ledger)



def _reserve(params: RunParams, ids: list[int]) -> int:
    """Tokens a request reserves against its dataset's budget while in flight."""
    g = params.generate
    return (g.reserve_completion_tokens or g.sampling.max_new_tokens) + (len(ids) if g.budget_counts == "total" else 0)


def _jobs(params: RunParams, plan: RunPlan) -> list:
    """The plan's pending prompts as the engine's jobs; the plan lets go of them, so a prompt is freed once its
    job is dispatched (the engine drops each job it sends) rather than held to the end of the run."""
    jobs = []
    pending, plan.pending = plan.pending, []
    for p, ids in pending:
        conv = plan.conversations.get((p.dataset, str(p.sample_id)))
        jobs.append(Job(p.dataset, p.sample_id, p.messages, p.tools, ids, reserve=_reserve(params, ids) if ids else 0,
                        prompt=p, turn=None if conv is None else conv.turn, conversation=conv))
    random.Random(f"dispatch:{params.generate.sampling.seed}").shuffle(jobs)  # a budget cut leaves a random subset
    return jobs


def _preparer(params: RunParams, tokenizer: Any, profile: Any):
    """The engine's `prepare`: template jobs' prompts (one tokenizer call); reject those that reach
    model.max_context."""

    def prepare(jobs: list[Any]) -> None:
        for job, ids in zip(jobs, template_prompts(tokenizer, [j.prompt for j in jobs], profile)):
            which = job.sample_id if job.turn is None else f"{job.sample_id}#{job.turn}"
            job.rejected = _too_long(params, job.dataset, which, ids)
            if job.rejected is None:
                job.prompt_ids, job.reserve = ids, _reserve(params, ids)

    return prepare


def _follower(params: RunParams, ledger: dict[str, DatasetLedger], tokenizer: Any, profile: Any):
    """The engine's `follow` (turns: all): a turn's record, before it is journaled -> its conversation's next
    turn, templated, or None (the conversation ended: its reason, `too_long` included, is now in the record;
    see `_take_turn`)."""
    def follow(job: Any, rec: dict[str, Any]) -> Any:
        conv = job.conversation
        end, tp, ids = _take_turn(params, conv, rec, ledger[job.dataset], tokenizer, profile)
        if end is not None:
            return None
        return Job(job.dataset, job.sample_id, tp.messages, tp.tools, ids, reserve=_reserve(params, ids), prompt=tp,
                   turn=conv.turn, conversation=conv)

    return follow


def _run_async(coro: Any) -> Any:
    """Run a coroutine from plain Python or from inside a running loop (a notebook cell)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    nest_asyncio.apply(loop)
    return loop.run_until_complete(coro)


def run_engine(engine: Any) -> Any:
    """Run an HTTP `Engine` to its end with SIGINT/SIGTERM asking it to stop gracefully (01, and 04's engine
    captures), from plain Python or a notebook cell."""

    async def main():
        loop = asyncio.get_running_loop()
        with _stop_signals(lambda signum, frame: loop.call_soon_threadsafe(engine.on_signal, signum)):
            return await engine.run()

    return _run_async(main())


def _run_http(params: RunParams, plan: RunPlan, profile: Any, tokenizer: Any, progress: bool):
    g = params.generate
    if g.backend == "sglang":
        if g.sglang.launch:  # a server started here for this run, stopped when it ends (sglang_server.py)
            with SGLangServer(sglang_command(params, g.sglang, stage="generate"), progress=progress) as srv:
                return _run_http(params.model_copy(update={"generate": g.model_copy(update={
                    "sglang": g.sglang.model_copy(update={"launch": False, "base_url": srv.base_url})})}),
                    plan, profile, tokenizer, progress)
        backend: Any = SGLangBackend(params, profile, tokenizer)
        base_url, credit_poll = g.sglang.base_url, 1e9
    elif g.backend == "vllm":
        if g.vllm.launch:  # a server started here for this run, stopped when it ends (vllm_server.py)
            cmd = server_command(params, g.vllm, stage="generate")
            # vLLM's CPU build samples noise or dies at T > 0 without its fixes (vllm_server.with_cpu_fixes)
            mark = with_cpu_fixes(cmd, params.run_dir, "generate") if g.sampling.temperature > 0 else None
            with VLLMServer(cmd, progress=progress) as srv:
                if mark is not None:
                    check_cpu_fixes(mark, "generate")
                return _run_http(params.model_copy(update={"generate": g.model_copy(update={
                    "vllm": g.vllm.model_copy(update={"launch": False, "base_url": srv.base_url})})}),
                    plan, profile, tokenizer, progress)
        backend = VLLMBackend(params, profile, tokenizer)
        base_url, credit_poll = g.vllm.base_url, 1e9
    else:
        backend = OpenAIBackend(params, profile)
        base_url, credit_poll = g.openai.base_url, g.openai.credit_poll_s
    settings = EngineSettings(
        concurrency=g.concurrency, timeout_s=g.timeout_s, max_retries=g.max_retries,
        max_rate_limit_retries=g.max_rate_limit_retries, retry_backoff_s=g.retry_backoff_s,
        retry_backoff_max_s=g.retry_backoff_max_s, cost_cap_usd=g.cost_cap_usd, stop_grace_s=g.stop_grace_s,
        budget_counts=g.budget_counts, ledger_interval_s=g.ledger_interval_s, credit_poll_s=credit_poll,
        journal_fsync=g.journal_fsync, http2=g.http2, seed=g.sampling.seed)
    run_dir = params.run_dir
    extra = {"torn_tail_bytes_repaired": plan.torn_tail_bytes, "backend": g.backend}
    engine = Engine(backend, _jobs(params, plan), base_url=base_url, settings=settings, ledger=plan.ledger,
                    journal_dir=run_dir / "records", run_dir=run_dir, done_keys=plan.done_keys,
                    budgets={d.name: d.token_budget for d in params.datasets}, ledger_extra=lambda: extra,
                    progress=progress, prepare=_preparer(params, tokenizer, profile),
                    follow=_follower(params, plan.ledger, tokenizer, profile) if plan.conversations else None)

    return run_engine(engine)


@contextlib.contextmanager
def _long_lived_heap() -> Iterator[None]:
    """Keep the garbage collector off what lives as long as the run (call `gc.freeze()` again inside to add
    what was made since).

    The tokenizer, the modules and then every prompt and job of the plan live until the run ends,
    and each full collection walks them all: at 20,000 prompts those pauses took 0.45 s of the plan
    and 0.5 s at a time during the run (2.6 s of a 44 s bench run), holding every response in flight
    behind them. Frozen (`gc.freeze`), they are left out of collections; unfrozen at the end, so a
    notebook's kernel gets them back. Only reference cycles made before a freeze wait until then.
    The youngest generation is collected every 20,000 allocations instead of 700 while the run lasts
    (the state of 2,000 requests in flight was walked ~1,800 times in a 44 s bench run: 1.2 s).
    """
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(20_000, 20, 10)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def run_generate(params: RunParams, *, progress: bool = True, model: Any = None, tokenizer: Any = None) -> GenerateSummary:
    """Generate every pending sample of the run with the backend in params; journal as it goes.

    Holds the run folder while it works (`core.runlock`): a second writer on a live folder is refused."""
    with hold_run(params.run_dir, "01_generate"), _long_lived_heap():
        return _generate(params, progress, model, tokenizer)


def _generate(params: RunParams, progress: bool, model: Any, tokenizer: Any) -> GenerateSummary:
    t0 = time.perf_counter()
    check_dataset_files(params)  # every prompt file exists and reads as its format, before any work
    profile = get_profile(params.profile)
    tokenizer = tokenizer or tokenizer_for(params)
    gc.freeze()
    run_dir = params.run_dir
    (run_dir / "records").mkdir(parents=True, exist_ok=True)
    stop_file = run_dir / "STOP"
    if stop_file.exists() and not os.environ.get(CLI_RUN_ENV):  # `eagle3data run` clears it itself, at its start
        stop_file.unlink()
        print(f"removed a STOP file left by an earlier run: {stop_file}", file=sys.stderr)
    write_provenance(run_dir, "01_generate", params)
    backend = params.generate.backend
    # HTTP backends template each prompt as it is dispatched (the first requests go out at once)
    plan = plan_run(params, tokenizer, profile, template=backend == "local")
    gc.freeze()  # the plan's prompts and jobs live as long as the run
    _report_resume(plan, progress)
    write_ledger(run_dir, plan.ledger, "running",
                 {"source": backend, "torn_tail_bytes_repaired": plan.torn_tail_bytes})
    if backend == "local":
        new, status, reason = _run_local(params, plan, profile, tokenizer, model, progress)
        write_ledger(run_dir, plan.ledger, status, {"source": "local", "stop_reason": reason,
                                                    "torn_tail_bytes_repaired": plan.torn_tail_bytes})
        if reason and progress:
            print(f"generate {status}: {reason}", file=sys.stderr)
        return GenerateSummary(run_dir, plan.ledger, time.perf_counter() - t0, new, status, reason,
                               torn_tail_bytes=plan.torn_tail_bytes, responses=new)
    if not plan.pending:
        write_ledger(run_dir, plan.ledger, "finished", {"source": backend, "stop_reason": None})
        return GenerateSummary(run_dir, plan.ledger, time.perf_counter() - t0, 0, torn_tail_bytes=plan.torn_tail_bytes)
    try:
        res = _run_http(params, plan, profile, tokenizer, progress)
    except GenerateError as e:
        write_ledger(run_dir, plan.ledger, "refused", {"source": backend, "stop_reason": str(e)})
        raise
    if res.stop_reason and progress:
        print(f"generate {res.status}: {res.stop_reason}", file=sys.stderr)
    return GenerateSummary(run_dir, plan.ledger, time.perf_counter() - t0, res.new_records, res.status,
                           res.stop_reason, plan.torn_tail_bytes, res.responses, res.seconds, res.cpu_s)
