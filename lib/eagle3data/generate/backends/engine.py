"""The asyncio engine under the HTTP backends: bounded concurrency, budgets, stop, journal.

One `httpx.AsyncClient` (pooled keep-alive connections) sends requests built by a backend
(`sglang.SGLangBackend`, `openai_api.OpenAIBackend`); at most `concurrency` requests are in
flight. Jobs are dispatched in the order given (run_generate shuffles them with the seed).

- Budget: a dataset stops dispatching when its done tokens plus the tokens reserved by its
  requests in flight reach `token_budget`; the rest are listed as skipped. The run stops
  dispatching when spent plus reserved cost (in flight x mean cost per response) reaches
  `cost_cap_usd`.
- Errors: each request is sent with its retries by `retries.RequestRetries` (429 pauses all
  requests, 408/5xx/timeouts back off, 402/401/403/404 stop dispatching at once).
- Stop: `request_stop` (signals, the `STOP` file, 402, cost cap) stops dispatching, waits up
  to the grace period for requests in flight, then cancels them; a second signal cancels
  at once. Cancelled samples are listed in the ledger and resent on resume.
- Every completed response is appended to its dataset journal at once (one write per line),
  and the ledger is rewritten every `ledger_interval_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import httpx

from eagle3data.core.errors import UserInputError
from eagle3data.generate.ledger import DatasetLedger, write_ledger
from eagle3data.core.progress import Progress, generate_figures, generate_line
from eagle3data.core.reader import SampleKey
from eagle3data.core.records import Journal
from eagle3data.generate.backends.retries import RequestRetries, StopDispatch
from eagle3data.generate.backends.transport import LeanTransport


# The client under the engine: the hand-written HTTP/1.1 pool (bench/bench_generate.py measures it against
# aiohttp and httpx over HTTP/2 by putting theirs here).
TRANSPORT: Callable[[], httpx.AsyncBaseTransport] = LeanTransport
PREPARE_CHUNK = 32
"""Jobs templated per `prepare` call: one tokenizer call for many prompts costs about half the CPU
per prompt of one call each, and 32 short prompts hold the loop ~5 ms."""


YIELD_EVERY_S = 0.002
"""The dispatch loop hands the event loop over at least this often while it sends a wave, so that
responses, TLS handshakes and the bytes of requests already sent are not held behind it."""


class GenerateError(UserInputError, RuntimeError):
    """The run cannot start or must stop (server mismatch, no credit, bad key): the message says why."""


@dataclass
class Job:
    """One prompt to send: its dataset, id, prompt messages/tools and locally templated ids.

    `prompt_ids` may be None until the engine's `prepare` templates the job (just before
    dispatch, or ahead of it while every slot is busy); `rejected` then says why it is not sent.
    A turn of a conversation (`generate.turns: all`) has its `turn` and `conversation`: when its
    record comes back, the engine's `follow` takes it into the conversation before it is journaled
    and gives the conversation's next turn, templated (or none: the conversation ended, and its
    reason, a too-long next prompt included, is written into the record).
    """

    dataset: str
    sample_id: int | str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int] | None
    reserve: int = 0
    prompt: Any = None
    rejected: str | None = None
    turn: int | None = None
    conversation: Any = None

    @property
    def key(self) -> SampleKey:
        return SampleKey.of(self)


class Backend(Protocol):
    """What the engine needs from an HTTP backend."""

    source: str
    batch_size: int
    path: str

    def headers(self) -> dict[str, str]: ...

    async def preflight(self, client: httpx.AsyncClient) -> dict[str, Any]: ...

    async def credit(self, client: httpx.AsyncClient) -> float | None: ...

    def build(self, jobs: Sequence[Job]) -> bytes: ...

    def parse(self, jobs: Sequence[Job], body: bytes, latency_s: float) -> list[dict[str, Any]]: ...

    def error_record(self, job: Job, message: str) -> dict[str, Any]: ...


def record_dict(job: Job, *, source: str, model: str, profile: str, sampling: dict[str, Any],
                **fields: Any) -> dict[str, Any]:
    """A journal record (the `records.Record` schema) for one job, as a plain dict."""
    rec: dict[str, Any] = {
        "dataset": job.dataset, "sample_id": job.sample_id, "source": source, "model": model, "profile": profile,
        "messages": job.messages, "tools": job.tools, "prompt_ids": job.prompt_ids, "output_ids": None,
        "ids_exact": False, "reasoning": None, "content": None, "tool_calls": None, "finish_reason": "error",
        "native_finish_reason": None, "usage": {"prompt_tokens": None, "completion_tokens": None,
                                                "reasoning_tokens": None, "cached_tokens": None},
        "cost_usd": None, "provider": None, "generation_id": None, "sampling": sampling, "latency_s": None,
        "error": None, "created_at": time.time(),
    }
    if job.turn is not None:
        rec["turn"] = job.turn
    rec.update(fields)
    return rec


def stop_file_reason(path: Path) -> str:
    """The stop reason a `STOP` file gives: its first line (who asked, e.g. `SIGINT received by eagle3data run`)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        text = []
    return f"{text[0][:200]} (STOP file)" if text and text[0].strip() else f"STOP file {path}"


@dataclass
class EngineSettings:
    """The knobs of one engine run (taken from GenerateParams by run_generate)."""

    concurrency: int = 64
    timeout_s: float = 600.0
    max_retries: int = 5
    max_rate_limit_retries: int = 50
    retry_backoff_s: float = 1.0
    retry_backoff_max_s: float = 60.0
    cost_cap_usd: float | None = None
    stop_grace_s: float = 60.0
    budget_counts: str = "total"
    ledger_interval_s: float = 1.0
    credit_poll_s: float = 30.0
    journal_fsync: bool = False
    http2: bool = True
    seed: int = 0


@dataclass
class EngineResult:
    """How an engine run ended."""

    status: str  # finished | stopped | cancelled
    stop_reason: str | None
    new_records: int
    responses: int
    seconds: float
    credit_left_usd: float | None = None
    preflight: dict[str, Any] = field(default_factory=dict)
    cpu_s: float = 0.0


class Engine(RequestRetries):
    """Runs jobs through one backend; journals records and keeps the ledger while it runs."""

    def __init__(self, backend: Backend, jobs: Sequence[Job], *, base_url: str, settings: EngineSettings,
                 ledger: dict[str, DatasetLedger], journal_dir: Path, run_dir: Path, done_keys: set,
                 budgets: dict[str, int | None], ledger_extra: Callable[[], dict] | None = None,
                 progress: bool = True, prepare: Callable[[list[Job]], None] | None = None,
                 follow: Callable[[Job, dict[str, Any]], Job | None] | None = None):
        self.backend = backend
        self.jobs = list(jobs)
        self.base_url = base_url.rstrip("/")
        self.s = settings
        self.ledger = ledger
        self.journal_dir = Path(journal_dir)
        self.run_dir = Path(run_dir)
        self.done_keys = done_keys
        self.budgets = budgets
        self.ledger_extra = ledger_extra or (lambda: {})
        self.prepare = prepare
        self.follow = follow  # turns: a journaled turn's record -> the conversation's next turn (or None)
        self._next_turns: deque[Job] = deque()  # conversations' next turns: dispatched before new conversations
        self.progress = Progress(progress, run_dir=self.run_dir, stage="01_generate")
        self.rng = random.Random(settings.seed)
        self.reserved: dict[str, int] = {k: 0 for k in ledger}
        self.in_flight_requests = 0
        self.stop_reason: str | None = None
        self.stop_deadline: float | None = None
        self.cancel_now = False
        self.pause_until = 0.0
        self.new_records = 0
        self.responses = 0
        self.duplicates = 0
        self.credit_left: float | None = None
        self._credit_spent_at_poll = 0.0
        self._journals: dict[str, Journal] = {}
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=64)
        self._t0 = time.monotonic()
        self._tokens0 = sum(v.prompt_tokens + v.completion_tokens for v in ledger.values())
        self._stop_file = self.run_dir / "STOP"

    # -- control -------------------------------------------------------------------------
    def request_stop(self, reason: str, *, grace: bool = True) -> None:
        """Stop dispatching; with `grace`, cancel what is still in flight after stop_grace_s."""
        if self.stop_reason is None:
            self.stop_reason = reason
            if grace:
                self.stop_deadline = time.monotonic() + self.s.stop_grace_s
        elif grace and self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.s.stop_grace_s
        self._wake.set()

    def on_signal(self, signum: int) -> None:
        """First signal: graceful stop; second: cancel everything in flight now."""
        name = signal.Signals(signum).name
        if self.stop_reason is not None and self.stop_deadline is not None:
            self.cancel_now = True
            self.stop_reason += f"; second {name}: cancelled in-flight requests"
            for t in list(self._tasks):
                t.cancel()
        else:
            self.request_stop(f"{name} received")
        self._wake.set()

    # -- accounting ----------------------------------------------------------------------
    def _spent(self) -> float:
        return sum(v.cost_usd for v in self.ledger.values())

    def _mean_cost(self) -> float:
        n = sum(v.done + v.errors for v in self.ledger.values())
        return self._spent() / n if n else 0.0

    def _budget_left(self, dataset: str) -> bool:
        budget = self.budgets.get(dataset)
        if budget is None:
            return True
        used = self.ledger[dataset].tokens(self.s.budget_counts) + self.reserved[dataset]
        return used < budget

    def _cost_left(self) -> bool:
        cap = self.s.cost_cap_usd
        if cap is None:
            return True
        return self._spent() + self.in_flight_requests * self._mean_cost() < cap

    def _journal(self, dataset: str) -> Journal:
        j = self._journals.get(dataset)
        if j is None:
            j = self._journals[dataset] = Journal(self.journal_dir / f"{dataset}.jsonl", fsync=self.s.journal_fsync)
        return j

    def _commit(self, job: Job, rec: dict[str, Any]) -> None:
        """Journal one record unless its key is already done; count it."""
        key = job.key
        if key in self.done_keys:
            self.duplicates += 1
            return
        nxt = self.follow(job, rec) if self.follow is not None and job.conversation is not None else None
        # `follow` wrote the conversation's end reason into it, if it ended (a too-long next prompt: too_long)
        self._journal(job.dataset).write(rec)
        if rec.get("finish_reason") != "error":
            self.done_keys.add(key)
        self.ledger[job.dataset].add_record(rec)
        self.new_records += 1
        if nxt is not None:
            self.ledger[job.dataset].planned += 1
            self._next_turns.append(nxt)

    # -- requests ------------------------------------------------------------------------
    async def _run_jobs(self, shard: int, jobs: list[Job]) -> None:
        try:
            records = await self._send(jobs)
            self.responses += 1
            for job, rec in zip(jobs, records):
                self._commit(job, rec)
        except asyncio.CancelledError:
            for j in jobs:
                self.ledger[j.dataset].cancel(j.sample_id)
            raise
        except StopDispatch as e:
            self.request_stop(str(e), grace=False)
            for j in jobs:
                self.ledger[j.dataset].skip(j.sample_id)
        finally:
            for j in jobs:
                self.reserved[j.dataset] -= j.reserve
                self.ledger[j.dataset].in_flight -= 1
            self.in_flight_requests -= 1
            self._slots.append(shard)
            self._wake.set()

    # -- loops ---------------------------------------------------------------------------
    def _prepare_from(self, start: int) -> None:
        """Template the jobs not yet templated among the next PREPARE_CHUNK from `start`, in one call."""
        chunk = [j for j in self.jobs[start:start + PREPARE_CHUNK] if j.prompt_ids is None and j.rejected is None]
        if chunk:
            self.prepare(chunk)

    def _ready(self, job: Job) -> bool:
        """Template the job if it is not yet (see `prepare`); False when it must not be sent."""
        if job.prompt_ids is None and job.rejected is None and self.prepare is not None:
            self.prepare([job])
        if job.rejected is not None:  # a conversation's turn here is its first, or a resumed one: no record says so
            self.ledger[job.dataset].reject(job.sample_id, job.rejected, turn=job.conversation is not None)
            return False
        return True

    def _more(self, i: int) -> bool:
        """Work is left: new jobs, conversations' next turns, or turns in flight whose next turn may follow."""
        return i < len(self.jobs) or bool(self._next_turns) or (self.follow is not None and self.in_flight_requests > 0)

    def _skip_rest(self, jobs: Sequence[Job]) -> None:
        for job in jobs:
            self.ledger[job.dataset].skip(job.sample_id)

    async def _prepare_ahead(self, jobs: list[Job], start: int) -> int:
        """While every slot is busy, template jobs ahead of dispatch, a chunk per loop turn; the next index."""
        i = start
        while i < len(jobs) and not self._wake.is_set():
            self._prepare_from(i)
            i += PREPARE_CHUNK
            await asyncio.sleep(0)  # a response that came in meanwhile goes first
        return min(i, len(jobs))

    async def _dispatch(self) -> None:
        jobs = self.jobs
        i = ahead = 0  # jobs[i:] are not dispatched (jobs[:i] are let go); jobs[:ahead] are templated
        bs = max(1, self.backend.batch_size)
        nxt = self._next_turns
        last_yield = time.perf_counter()
        while self._more(i) and self.stop_reason is None:
            if not self._slots or (i >= len(jobs) and not nxt):  # nothing to send until a turn comes back
                self._wake.clear()
                if self._slots:
                    await self._wake.wait()
                    continue
                if self.prepare is not None and ahead < len(jobs):
                    ahead = await self._prepare_ahead(jobs, max(ahead, i))
                await self._wake.wait()
                continue
            await self._wait_pause()
            if self.stop_reason is not None:
                break
            if not self._cost_left():
                self.request_stop(f"cost cap ${self.s.cost_cap_usd:g} reached (spent + reserved)", grace=False)
                break
            batch: list[Job] = []
            while (nxt or i < len(jobs)) and len(batch) < bs:
                if nxt:  # a conversation's next turn goes before a new conversation
                    job = nxt.popleft()
                else:
                    job = jobs[i]
                    if job.prompt_ids is None and job.rejected is None and self.prepare is not None:
                        self._prepare_from(i)
                    jobs[i] = None  # type: ignore[call-overload]  # let go: its task holds it until journaled
                    i += 1
                if not self._ready(job):
                    continue
                if not self._budget_left(job.dataset):
                    self.ledger[job.dataset].budget_reached = True
                    self.ledger[job.dataset].skip(job.sample_id)
                    if job.conversation is not None:
                        self.ledger[job.dataset].end_conversation("budget")
                    continue
                self.reserved[job.dataset] += job.reserve
                self.ledger[job.dataset].in_flight += 1
                batch.append(job)
            if not batch:
                continue
            self.in_flight_requests += 1
            task = asyncio.create_task(self._run_jobs(self._slots.popleft(), batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            now = time.perf_counter()
            if now - last_yield > YIELD_EVERY_S:  # let responses and handshakes in while a large wave goes out
                await asyncio.sleep(0)
                last_yield = time.perf_counter()
        self._skip_rest(jobs[i:])
        self._skip_rest(nxt)
        nxt.clear()

    def _status_line(self, final: bool = False) -> str:
        return generate_line(self._figures(final), final=final)

    def _figures(self, final: bool = False) -> dict[str, Any]:
        """The progress figures: rates over the last ~10 s (whole-session averages at the end)."""
        now = time.monotonic()
        tokens = sum(v.prompt_tokens + v.completion_tokens for v in self.ledger.values())
        self._samples.append((now, self.responses, tokens))
        t_old, r_old, k_old = self._samples[0]
        for t, r, k in self._samples:  # a window of about 10 s
            if now - t <= 10:
                t_old, r_old, k_old = t, r, k
                break
        dt = max(1e-9, now - t_old)
        rps = (self.responses - r_old) / dt if dt > 0.2 else 0.0
        tps = (tokens - k_old) / dt if dt > 0.2 else 0.0
        if final:  # whole-run averages (this session's responses)
            dt = max(1e-9, now - self._t0)
            rps, tps = self.responses / dt, (tokens - self._tokens0) / dt
        spent = self._spent()
        credit = None
        if self.credit_left is not None:
            credit = self.credit_left - (spent - self._credit_spent_at_poll)
        f = generate_figures(self.ledger, counts=self.s.budget_counts, elapsed_s=now - self._t0,
                             session_done=self.new_records, cost_cap_usd=self.s.cost_cap_usd,
                             credit_left_usd=credit, in_flight=self.in_flight_requests,
                             rate_rps=round(rps, 2), tokens_per_s=round(tps, 1), stop_reason=self.stop_reason)
        self.last_figures = f
        return f

    def _show(self, final: bool = False) -> None:
        f = self._figures(final)
        self.progress.update(generate_line(f, final=final), final=final, figures=f)

    def write_ledger(self, status: str) -> None:
        extra = {"stop_reason": self.stop_reason, "source": self.backend.source,
                 "duplicates_dropped": self.duplicates, "credit_left_usd": self.credit_left,
                 **self.ledger_extra()}
        write_ledger(self.run_dir, self.ledger, status, extra)

    async def _tick(self, client: httpx.AsyncClient) -> None:
        next_poll = time.monotonic() + self.s.credit_poll_s
        while True:
            await asyncio.sleep(self.s.ledger_interval_s)
            if self.stop_reason is None and self._stop_file.exists():
                self.request_stop(stop_file_reason(self._stop_file))
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.s.credit_poll_s
                try:
                    c = await self.backend.credit(client)
                except (httpx.HTTPError, GenerateError, ValueError):
                    c = None
                if c is not None:
                    self.credit_left, self._credit_spent_at_poll = c, self._spent()
            self.write_ledger("stopping" if self.stop_reason else "running")
            self._show()

    async def run(self) -> EngineResult:
        """Preflight the server, run every job, wait for (or cancel) what is in flight."""
        # One client; its transport keeps a free list of connections (httpcore's pool rescans all of
        # its connections several times per request: O(n^2) CPU at 2,000 in flight). Generation
        # requests go straight to the transport with the client's headers, prepared once.
        timeout = httpx.Timeout(self.s.timeout_s, connect=min(self.s.timeout_s, 30.0), pool=None)
        self._slots = deque([0] * self.s.concurrency)
        t0 = time.monotonic()
        cpu0 = time.process_time()
        async with contextlib.AsyncExitStack() as stack:
            self._transport = TRANSPORT() if self.s.http2 else LeanTransport(http2=False)
            client = await stack.enter_async_context(httpx.AsyncClient(
                base_url=self.base_url, timeout=timeout, headers=self.backend.headers(), transport=self._transport))
            proto = client.build_request("POST", self.backend.path, content=b"")
            self._url = proto.url
            self._headers = [(k.lower(), v) for k, v in proto.headers.raw
                             if k.lower() not in (b"content-length", b"accept-encoding")]
            self._headers.append((b"accept-encoding", b"identity"))  # bodies are read as sent
            info = await self.backend.preflight(client)
            warm = getattr(self._transport, "warm", None)
            if warm is not None and self.jobs:
                # the connect timeout: a server that accepts and never completes a handshake is the requests' to
                # time out and report
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout.connect):
                        await warm(self._url, self.s.concurrency)
            self.credit_left = info.get("credit_left_usd")
            self._credit_spent_at_poll = self._spent()
            ticker = asyncio.create_task(self._tick(client))
            try:
                await self._dispatch()
                while self._tasks:
                    if self.cancel_now or (self.stop_deadline is not None and time.monotonic() >= self.stop_deadline):
                        for t in list(self._tasks):
                            t.cancel()
                        await asyncio.gather(*list(self._tasks), return_exceptions=True)
                        break
                    await asyncio.sleep(0.05)
            finally:
                ticker.cancel()
                for t in list(self._tasks):
                    t.cancel()
                # every task of the run ends here: under a loop that outlives the run (a notebook's, nest_asyncio)
                # none is left pending behind it
                await asyncio.gather(ticker, *list(self._tasks), return_exceptions=True)
                self._skip_rest(self._next_turns)  # next turns of replies that came in after the stop
                self._next_turns.clear()
                for j in self._journals.values():
                    j.close()
        cancelled = any(v.cancelled for v in self.ledger.values())
        status = "finished" if self.stop_reason is None else ("cancelled" if cancelled else "stopped")
        self.write_ledger(status)
        self._show(final=True)
        return EngineResult(status, self.stop_reason, self.new_records, self.responses,
                            time.monotonic() - t0, self.credit_left, info, time.process_time() - cpu0)
