"""Stage 01's local backend: the one loop over continuous batching, in process, exact ids.

`_run_local` hands the backend the next prompt that is sent whenever a slot frees (a prompt whose dataset
reached its token budget leaves its place to the next), journals every finished row as a `Record`
(`_local_record`), and queues a conversation's next turn once its turn is journaled (`turns: all`).
A first SIGINT/SIGTERM or a `STOP` file stops admitting prompts: the rows in flight finish and are
journaled; a second signal drops them (`_LocalStop`).
"""

from __future__ import annotations

import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from eagle3data.core.models import model_for
from eagle3data.core.params import RunParams
from eagle3data.core.progress import Progress, generate_figures, generate_line
from eagle3data.core.records import Journal, Record, Usage
from eagle3data.core.spans import output_texts
from eagle3data.generate.backends.engine import stop_file_reason
from eagle3data.generate.backends.local import LocalBackend
from eagle3data.generate.ledger import write_ledger
from eagle3data.generate.plan import RunPlan, _take_turn
from eagle3data.generate.signals import _stop_signals
from eagle3data.generate.turns import Conversation
from eagle3data.prompts.load import Prompt


def _sampling_dict(params: RunParams) -> dict[str, Any]:
    return params.generate.sampling.model_dump(exclude_none=True)


def _local_record(params: RunParams, prompt: Prompt, prompt_ids: list[int], res: dict[str, Any],
                  profile: Any, tokenizer: Any) -> Record:
    text = output_texts(res["output_ids"], profile, tokenizer)
    return Record(
        dataset=prompt.dataset, sample_id=prompt.sample_id, source="local", model=params.model.name,
        profile=profile.name, messages=prompt.messages, tools=prompt.tools, prompt_ids=prompt_ids,
        output_ids=res["output_ids"], ids_exact=True, reasoning=text.reasoning, content=text.content,
        tool_calls=text.tool_calls, finish_reason=res["finish_reason"],
        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(res["output_ids"])),
        sampling=_sampling_dict(params), latency_s=round(res["latency_s"], 4), created_at=time.time(),
    )


class _LocalStop:
    """Stop requests for the local backend.

    First SIGINT/SIGTERM or a `STOP` file in the run folder: admit no more prompts, finish and
    journal the rows in flight, then stop. A second signal raises KeyboardInterrupt inside the
    model's work: those rows are dropped, everything journaled before it stays.
    """

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        self.reason: str | None = None
        self.cancelled = False
        self.in_batch = False  # True only while the model generates: journaling is never interrupted

    def on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.reason is None:
            self.reason = f"{name} received: stopping after the rows in flight"
            print(f"generate: {self.reason} (send it again to drop them)", file=sys.stderr)
        elif not self.cancelled and self.in_batch:
            self.reason += f"; second {name}: the rows in flight were dropped"
            self.cancelled = True
            raise KeyboardInterrupt(self.reason)

    def requested(self) -> bool:
        if self.reason is None and self.stop_file.exists():
            self.reason = stop_file_reason(self.stop_file)
        return self.reason is not None


def _run_local(params: RunParams, plan: RunPlan, profile: Any, tokenizer: Any, model: Any,
               progress: bool) -> tuple[int, str, str | None]:
    """The local backend's one loop; (new records, status, stop reason).

    The queue holds the pending prompts, shortest first. The backend decodes up to `batch_size` rows
    together and asks for the next prompt whenever a slot frees (continuous batching): a prompt whose
    dataset has reached its token budget is skipped as it comes off the queue and the next one takes its
    place, so slots stay full. Each finished row is journaled at once; with turns: all, a conversation's
    next turn is templated from its history once the turn before it is journaled, and joins the queue
    (a `turns: last` prompt has no conversation). A stop (signal or STOP file) ends the admissions: the
    rows in flight finish and are journaled; a second signal drops them.
    """
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
    sent: dict[int, Prompt] = {}  # admitted, not yet journaled: what a second signal drops

    def show(final: bool = False) -> None:
        f = generate_figures(ledger, counts=counts, elapsed_s=time.monotonic() - t_start, session_done=new,
                             stop_reason=stop.reason)
        live.update(generate_line(f, final=final), final=final, figures=f)

    def pull() -> tuple[tuple[Prompt, list[int], Conversation | None], list[int]] | None:
        """The next prompt that is sent, or None (queue empty or a stop requested); never interrupted."""
        stop.in_batch = False
        try:
            while queue and not stop.requested():
                p, ids = queue.popleft()
                conv = plan.conversations.get((p.dataset, str(p.sample_id)))  # None: a turns: last dataset
                b = budgets.get(p.dataset)
                if b is not None and ledger[p.dataset].tokens(counts) >= b:
                    ledger[p.dataset].budget_reached = True
                    ledger[p.dataset].skip(p.sample_id)
                    if conv is not None:
                        ledger[p.dataset].end_conversation("budget")
                    continue
                sent[id(p)] = p
                return (p, ids, conv), ids
            return None
        finally:
            stop.in_batch = True

    show()
    rows = backend.stream(pull)
    try:
        with _stop_signals(stop.on_signal):
            while True:
                stop.in_batch = True
                try:
                    (p, ids, conv), res = next(rows)
                except StopIteration:
                    break
                finally:
                    stop.in_batch = False
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
                del sent[id(p)]
                new += 1
                if end is None:
                    assert tp is not None and nids is not None
                    led.planned += 1
                    queue.append((tp, nids))
                write_ledger(run_dir, ledger, "running", {"source": "local"})
                show()
    except KeyboardInterrupt:
        if not stop.cancelled:
            raise  # not ours (e.g. a notebook's interrupt outside the handlers' reach)
        for p in sent.values():  # the rows in flight were dropped
            ledger[p.dataset].cancel(p.sample_id)
    finally:
        rows.close()
        for j in journals.values():
            j.close()
    for p, _ in queue:  # never sent: a stop came first (the conversation goes on at resume)
        ledger[p.dataset].skip(p.sample_id)
    show(final=True)
    if stop.reason is None:
        return new, "finished", None
    return new, "cancelled" if stop.cancelled else "stopped", stop.reason
