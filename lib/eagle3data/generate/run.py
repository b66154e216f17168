"""Stage 01: run prompt datasets through the target and journal every response as it completes.

`run_generate(params)` templates every prompt with the profile's options, skips samples the
journal already holds (resume keyed by `(dataset, sample_id)`; a torn last line is cut off
and reported), and generates with the backend named in params:

- `local`: batched in-process generation; exact ids. Batches are filled with prompts that are sent
  (one a budget skips leaves its place to the next). A first SIGINT/SIGTERM or a `STOP` file
  stops after the batch in progress is journaled; a second signal drops that batch.
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
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eagle3data.generate.ledger import DatasetLedger, ledger_frame, provider_frame, read_ledger, write_ledger
from eagle3data.core.params import RunParams
from eagle3data.core.profiles import get_profile
from eagle3data.prompts.load import Prompt, PromptDataError, PromptSet, load_datasets, template_prompt, template_prompts
from eagle3data.core.reader import SampleKey
from eagle3data.core.records import Journal, Record, Usage, scan_journal
from eagle3data.generate.turns import Conversation, end_kind

# Set by `eagle3data run` for the kernel it starts: a STOP file there is that run's own stop request
# (written on Ctrl-C before this stage got going), never a stale one to remove.
CLI_RUN_ENV = "EAGLE3DATA_CLI_RUN"

__all__ = ["run_generate", "GenerateSummary", "DatasetLedger", "write_ledger", "read_ledger", "plan_run"]


def _sampling_dict(params: RunParams) -> dict[str, Any]:
    return params.generate.sampling.model_dump(exclude_none=True)


def _local_record(params: RunParams, prompt: Prompt, prompt_ids: list[int], res: dict[str, Any],
                  profile: Any, tokenizer: Any) -> Record:
    from eagle3data.core.spans import output_texts

    text = output_texts(res["output_ids"], profile, tokenizer)
    return Record(
        dataset=prompt.dataset, sample_id=prompt.sample_id, source="local", model=params.model.name,
        profile=profile.name, messages=prompt.messages, tools=prompt.tools, prompt_ids=prompt_ids,
        output_ids=res["output_ids"], ids_exact=True, reasoning=text.reasoning, content=text.content,
        tool_calls=text.tool_calls, finish_reason=res["finish_reason"],
        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(res["output_ids"])),
        sampling=_sampling_dict(params), latency_s=round(res["latency_s"], 4), created_at=time.time(),
    )


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


@dataclass
class RunPlan:
    """What is left to do: the ledger so far, the prompts to send, and what resume found."""

    ledger: dict[str, DatasetLedger]
    pending: list[tuple[Prompt, list[int] | None]]
    done_keys: set[SampleKey]
    torn_tail_bytes: dict[str, int]
    bad_lines: list[str]
    # turns: all: each pending entry is a conversation's next turn; its Conversation by (dataset, sample_id)
    conversations: dict[tuple[str, str], Conversation] = field(default_factory=dict)


def plan_run(params: RunParams, tokenizer: Any, profile: Any, *, template: bool = True) -> RunPlan:
    """Read the journals (cutting a torn last line), count what is done, template what is not.

    With `template=False` the pending prompts carry no ids yet (None): the HTTP engine
    templates each one as it dispatches, so the first requests go out at once instead of
    after every prompt of the run has been templated.
    """
    run_dir = params.run_dir
    sets = load_datasets(params)
    _check_prompt_sets(params, sets)
    ledger: dict[str, DatasetLedger] = {}
    pending: list[tuple[Prompt, list[int] | None]] = []
    done_keys: set[SampleKey] = set()
    convs: dict[tuple[str, str], Conversation] = {}
    modes = turns_by_dataset(params)
    torn: dict[str, int] = {}
    bad: list[str] = []
    budgets = {d.name: d.token_budget for d in params.datasets}
    retry_errors = params.generate.retry_errors
    for name, ps in sets.items():
        led = ledger[name] = DatasetLedger(planned=len(ps.prompts), rejected_prompt_lines=list(ps.skipped),
                                           budget_tokens=budgets.get(name))
        final: dict[SampleKey, dict[str, Any]] = {}
        scan = scan_journal(run_dir / "records" / f"{name}.jsonl", repair=True)
        if scan.torn_tail_bytes:
            torn[name] = scan.torn_tail_bytes
        bad.extend(scan.bad_lines)
        if scan.records and not params.generate.resume:
            raise ValueError(f"{run_dir / 'records' / (name + '.jsonl')} already holds {len(scan.records)} records "
                             "and generate.resume is false: use a new run_name (journals are never rewritten)")
        all_turns = modes[name] == "all"
        other = next((r for r in scan.records if (r.get("turn") is None) == all_turns), None)
        if other is not None:
            raise ValueError(f"{run_dir / 'records' / (name + '.jsonl')}: record {other['sample_id']!r} was generated "
                             f"with turns {'last' if all_turns else 'all'}, and this run asks for {modes[name]}: "
                             "use a new run_name (one journal, one way of generating)")
        if all_turns:
            _plan_conversations(params, name, ps, scan.records, led, tokenizer, profile, template, pending,
                                done_keys, convs)
            continue
        plan_keys = {SampleKey.of(p) for p in ps.prompts} if scan.records else set()
        for r in scan.records:
            k = SampleKey.of(r)
            if k in plan_keys and (k not in final or final[k]["finish_reason"] == "error"):
                final[k] = r
        for k, r in final.items():
            led.add_record(r)
            if r["finish_reason"] != "error":
                done_keys.add(k)
            elif retry_errors:
                led.remove_error(r)
            else:
                done_keys.add(k)
        led.resumed = led.done
        todo = [p for p in ps.prompts if SampleKey.of(p) not in done_keys] if final else ps.prompts
        if not template:
            pending.extend((p, None) for p in todo)
            continue
        for p, ids in zip(todo, template_prompts(tokenizer, todo, profile)):
            too_long = _too_long(params, name, p.sample_id, ids)
            if too_long:
                led.reject(p.sample_id, too_long)
                continue
            pending.append((p, ids))
    return RunPlan(ledger, pending, done_keys, torn, bad, convs)


def turns_by_dataset(params: RunParams) -> dict[str, str]:
    """Each dataset's turns mode: its own `turns`, else `generate.turns`."""
    return {d.name: d.turns or params.generate.turns for d in params.datasets}


def _plan_conversations(params: RunParams, name: str, ps: PromptSet, records: list[dict[str, Any]],
                        led: DatasetLedger, tokenizer: Any, profile: Any, template: bool,
                        pending: list[tuple[Prompt, list[int] | None]], done_keys: set[SampleKey],
                        convs: dict[tuple[str, str], Conversation]) -> None:
    """turns: all: replay each conversation's journaled turns in order (the history of the next turn is
    rebuilt from them); its next turn is pending unless it ended. A turn's record is its first completed
    line (an error is replaced by a later line of its turn); a history is never built from an error:
    with retry_errors the error turn is pending again, else the conversation ended there. A conversation
    whose last record says it ended (`conversation_end`) is not continued (`Conversation.replay`; only a
    `max_turns` end is judged again, by this run's generate.max_turns)."""
    led.planned = 0
    led.conversations = len(ps.prompts)
    by_turn: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        turns = by_turn.setdefault(str(r["sample_id"]), {})
        t = int(r["turn"])
        if t not in turns or turns[t]["finish_reason"] == "error":
            turns[t] = r
    for p in ps.prompts:
        conv = Conversation(p, params.generate.max_turns)
        recs = by_turn.get(str(p.sample_id), {})
        while conv.turn in recs and conv.ended is None:
            r = recs[conv.turn]
            led.add_record(r)
            if r["finish_reason"] == "error" and params.generate.retry_errors:
                led.remove_error(r)  # sent again: its new line supersedes the error
                break
            led.planned += 1
            done_keys.add(SampleKey.of(r))
            conv.replay(r)  # a journaled end (too_long) is final
        if conv.ended is not None:
            if end_kind(conv.ended) == "too_long":  # its next turn, never sent, is counted as the run that cut it did
                led.planned += 1
                led.reject(p.sample_id, f"{name}:{p.sample_id}#{conv.turn}: {conv.ended.split(': ', 2)[-1]}",
                           turn=True)
            else:
                led.end_conversation(conv.ended)
            continue
        led.planned += 1
        tp = conv.turn_prompt()
        ids = None
        if template:
            ids = template_prompt(tokenizer, tp, profile)
            too_long = _too_long(params, name, f"{p.sample_id}#{conv.turn}", ids)
            if too_long:
                led.reject(p.sample_id, too_long, turn=True)
                continue
        pending.append((tp, ids))
        convs[(name, str(p.sample_id))] = conv
    led.resumed = led.done


def _check_prompt_sets(params: RunParams, sets: dict[str, PromptSet]) -> None:
    """Print each dataset's rejected rows (count, reasons, first few) on stdout; stop the run
    (PromptDataError) when a dataset has no usable prompt or rejects more than its max_rejected_share."""
    stops = []
    for d in params.datasets:
        ps = sets[d.name]
        if ps.rejected:
            print("\n".join(ps.summary()), flush=True)
        first = f"; first: {ps.rejected[0]}" if ps.rejected else ""
        if not ps.prompts:
            stops.append(f"dataset {d.name}: no usable prompt in {ps.path} (format {ps.format}, {ps.rows} rows, "
                         f"{len(ps.rejected)} rejected){first}")
        elif ps.rejected_share > d.max_rejected_share:
            stops.append(f"dataset {d.name}: {ps.malformed} of {ps.rows} rows rejected ({ps.rejected_share:.0%}) in "
                         f"{ps.path}, more than max_rejected_share {d.max_rejected_share:g} (format {ps.format}){first}")
    if stops:
        hint = "see `python -m eagle3data prompts PATH --format FORMAT` for every rejected row"
        raise PromptDataError("\n".join(stops) + f"\n{hint}")


def _report_resume(plan: RunPlan, progress: bool) -> None:
    for name, n in plan.torn_tail_bytes.items():
        print(f"resume: cut a torn last line ({n} bytes) off records/{name}.jsonl (a write cut by a crash)",
              file=sys.stderr)
    for line in plan.bad_lines[:10]:
        print(f"resume: skipped unreadable journal line {line}", file=sys.stderr)
    if progress:
        resumed = sum(v.done + v.errors for v in plan.ledger.values())
        if resumed:
            print(f"resume: {resumed:,} samples already in the journal; {len(plan.pending):,} to generate",
                  file=sys.stderr)


@contextlib.contextmanager
def _stop_signals(handler: Any) -> Iterator[None]:
    """SIGINT/SIGTERM go to `handler(signum, frame)` while the run lasts, then back to what they were.

    Only the main thread can set signal handlers; elsewhere (a worker thread) nothing is changed.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


class _LocalStop:
    """Stop requests for the local backend, which runs one batch at a time.

    First SIGINT/SIGTERM or a `STOP` file in the run folder: finish and journal the batch in
    progress, then stop. A second signal raises KeyboardInterrupt inside the batch: it is
    dropped, everything journaled before it stays.
    """

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        self.reason: str | None = None
        self.cancelled = False
        self.in_batch = False  # True only while the model generates: journaling is never interrupted

    def on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.reason is None:
            self.reason = f"{name} received: stopping after the batch in progress"
            print(f"generate: {self.reason} (send it again to drop that batch)", file=sys.stderr)
        elif not self.cancelled and self.in_batch:
            self.reason += f"; second {name}: the batch in progress was dropped"
            self.cancelled = True
            raise KeyboardInterrupt(self.reason)

    def requested(self) -> bool:
        if self.reason is None and self.stop_file.exists():
            from eagle3data.generate.backends.engine import stop_file_reason

            self.reason = stop_file_reason(self.stop_file)
        return self.reason is not None


def _take_turn(params: RunParams, conv: Conversation, rec: dict[str, Any], led: DatasetLedger, tokenizer: Any,
               profile: Any) -> tuple[str | None, Prompt | None, list[int] | None]:
    """Take a turn's record into its conversation, before the record is journaled: (the end reason, or None and
    the next turn's prompt and ids).

    When the conversation ends here, its reason goes into the record (`conversation_end`), and the ledger counts
    it. That is the conversation's own end (`Conversation.advance`: done, max_turns, a tool call that does not
    match, a reply cut or failed), or `too_long`: the next turn's prompt (the history, this reply, the dataset's
    next user or tool turn) is templated here, while this record can still say so, and when it reaches
    model.max_context the conversation ends with `too_long: turn T: prompt of N tokens reaches ...`; that
    turn is counted planned and rejected (never sent). A next turn that is sent is the caller's to count planned.
    """
    end = conv.advance(rec)
    if end is None:
        tp = conv.turn_prompt()
        ids = template_prompt(tokenizer, tp, profile)
        why = _too_long_why(params, ids)
        if why is None:
            return None, tp, ids
        led.planned += 1
        led.reject(conv.sample_id, f"{conv.dataset}:{conv.sample_id}#{conv.turn}: {why}", turn=True)
        end = conv.end(f"too_long: turn {conv.turn}: {why}")
    else:
        led.end_conversation(end)
    rec["conversation_end"] = end
    return end, None, None


def _run_local(params: RunParams, plan: RunPlan, profile: Any, tokenizer: Any, model: Any,
               progress: bool) -> tuple[int, str, str | None]:
    """The local backend's one batch loop; (new records, status, stop reason).

    The queue holds the pending prompts, shortest first (similar lengths together: less padding per
    batch). Each batch is filled with up to `batch_size` prompts that are sent: a prompt whose dataset
    has reached its token budget is skipped as it comes off the queue and the next one takes its place,
    so batches stay full. With turns: all, a conversation's next turn is templated from its history once
    the turn before it is journaled, and joins the queue (a `turns: last` prompt has no conversation).
    A stop (signal or STOP file) is looked at between batches: the batch in progress is journaled first.
    """
    from collections import deque

    from eagle3data.generate.backends.local import LocalBackend
    from eagle3data.core.models import model_for
    from eagle3data.core.progress import Progress, generate_figures, generate_line

    run_dir = params.run_dir
    ledger = plan.ledger
    queue = deque(sorted(plan.pending, key=lambda x: len(x[1])))  # similar lengths together
    budgets = {d.name: d.token_budget for d in params.datasets}
    counts = params.generate.budget_counts
    new = 0
    if not queue:
        return 0, "finished", None
    model = model or model_for(params)
    backend = LocalBackend(model, tokenizer, profile, params.generate.sampling, params.generate.batch_size)
    journals: dict[str, Journal] = {}
    live = Progress(progress, run_dir=run_dir, stage="01_generate")
    t_start = time.monotonic()
    stop = _LocalStop(run_dir / "STOP")

    def show(final: bool = False) -> None:
        f = generate_figures(ledger, counts=counts, elapsed_s=time.monotonic() - t_start, session_done=new,
                             stop_reason=stop.reason)
        live.update(generate_line(f, final=final), final=final, figures=f)

    show()
    bs = params.generate.batch_size
    chunk: list[tuple[Prompt, list[int], Conversation | None]] = []
    try:
        with _stop_signals(stop.on_signal):
            while queue and not stop.requested():
                chunk = []
                while queue and len(chunk) < bs:
                    p, ids = queue.popleft()
                    conv = plan.conversations.get((p.dataset, str(p.sample_id)))  # None: a turns: last dataset
                    b = budgets.get(p.dataset)
                    if b is not None and ledger[p.dataset].tokens(counts) >= b:
                        ledger[p.dataset].budget_reached = True
                        ledger[p.dataset].skip(p.sample_id)
                        if conv is not None:
                            ledger[p.dataset].end_conversation("budget")
                        continue
                    chunk.append((p, ids, conv))
                if not chunk:
                    continue
                stop.in_batch = True
                results = backend.generate_batch([ids for _, ids, _ in chunk])
                stop.in_batch = False
                for (p, ids, conv), res in zip(chunk, results):
                    led = ledger[p.dataset]
                    rec = _local_record(params, p, ids, res, profile, tokenizer).model_dump(mode="json")
                    end, tp, nids = "single", None, None
                    if conv is not None:  # the next turn is templated before this record is written (too_long)
                        rec["turn"] = conv.turn
                        end, tp, nids = _take_turn(params, conv, rec, led, tokenizer, profile)
                    j = journals.get(p.dataset) or journals.setdefault(
                        p.dataset, Journal(run_dir / "records" / f"{p.dataset}.jsonl"))
                    j.write(rec)
                    led.add_record(rec)
                    new += 1
                    if end is not None:
                        continue
                    assert tp is not None and nids is not None
                    led.planned += 1
                    queue.append((tp, nids))
                chunk = []
                write_ledger(run_dir, ledger, "running", {"source": "local"})
                show()
    except KeyboardInterrupt:
        if not stop.cancelled:
            raise  # not ours (e.g. a notebook's interrupt outside the handlers' reach)
        for p, _, _ in chunk:  # the batch that was dropped
            ledger[p.dataset].cancel(p.sample_id)
    finally:
        for j in journals.values():
            j.close()
    for p, _ in queue:  # never sent: a stop came first (the conversation goes on at resume)
        ledger[p.dataset].skip(p.sample_id)
    show(final=True)
    if stop.reason is None:
        return new, "finished", None
    return new, "cancelled" if stop.cancelled else "stopped", stop.reason


def _reserve(params: RunParams, ids: list[int]) -> int:
    """Tokens a request reserves against its dataset's budget while in flight."""
    g = params.generate
    return (g.reserve_completion_tokens or g.sampling.max_new_tokens) + (len(ids) if g.budget_counts == "total" else 0)


def _jobs(params: RunParams, plan: RunPlan) -> list:
    from eagle3data.generate.backends.engine import Job

    jobs = []
    for p, ids in plan.pending:
        conv = plan.conversations.get((p.dataset, str(p.sample_id)))
        jobs.append(Job(p.dataset, p.sample_id, p.messages, p.tools, ids, reserve=_reserve(params, ids) if ids else 0,
                        prompt=p, turn=None if conv is None else conv.turn, conversation=conv))
    random.Random(f"dispatch:{params.generate.sampling.seed}").shuffle(jobs)  # a budget cut leaves a random subset
    return jobs


def _too_long(params: RunParams, dataset: str, sample_id: Any, ids: list[int]) -> str | None:
    """Why a templated prompt is not sent (it reaches model.max_context), or None."""
    why = _too_long_why(params, ids)
    return None if why is None else f"{dataset}:{sample_id}: {why}"


def _too_long_why(params: RunParams, ids: list[int]) -> str | None:
    """`prompt of N tokens reaches model.max_context M` when a templated prompt is too long to send, else None."""
    max_ctx = params.model.max_context
    if max_ctx is not None and len(ids) >= max_ctx:
        return f"prompt of {len(ids)} tokens reaches model.max_context {max_ctx}"
    return None


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
    from eagle3data.generate.backends.engine import Job

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
    import nest_asyncio

    nest_asyncio.apply(loop)
    return loop.run_until_complete(coro)


def _run_http(params: RunParams, plan: RunPlan, profile: Any, tokenizer: Any, progress: bool):
    from eagle3data.generate.backends.engine import Engine, EngineSettings

    g = params.generate
    if g.backend == "sglang":
        from eagle3data.generate.backends.sglang import SGLangBackend

        backend: Any = SGLangBackend(params, profile, tokenizer)
        base_url, credit_poll = g.sglang.base_url, 1e9
    elif g.backend == "vllm":
        from eagle3data.generate.backends.vllm import VLLMBackend

        backend = VLLMBackend(params, profile, tokenizer)
        base_url, credit_poll = g.vllm.base_url, 1e9
    else:
        from eagle3data.generate.backends.openai_api import OpenAIBackend

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

    async def main():
        loop = asyncio.get_running_loop()
        with _stop_signals(lambda signum, frame: loop.call_soon_threadsafe(engine.on_signal, signum)):
            return await engine.run()

    return _run_async(main())


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
    """Generate every pending sample of the run with the backend in params; journal as it goes."""
    with _long_lived_heap():
        return _generate(params, progress, model, tokenizer)


def _generate(params: RunParams, progress: bool, model: Any, tokenizer: Any) -> GenerateSummary:
    from eagle3data.core.models import tokenizer_for
    from eagle3data.prompts.load import check_dataset_files
    from eagle3data.core.provenance import write_provenance

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
    except Exception as e:
        from eagle3data.generate.backends.engine import GenerateError

        if isinstance(e, GenerateError):
            write_ledger(run_dir, plan.ledger, "refused", {"source": backend, "stop_reason": str(e)})
        raise
    if res.stop_reason and progress:
        print(f"generate {res.status}: {res.stop_reason}", file=sys.stderr)
    return GenerateSummary(run_dir, plan.ledger, time.perf_counter() - t0, res.new_records, res.status,
                           res.stop_reason, plan.torn_tail_bytes, res.responses, res.seconds, res.cpu_s)
