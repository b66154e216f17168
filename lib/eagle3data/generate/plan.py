"""Stage 01's plan: what to send, what resume finds by key, and each conversation's next turn.

`plan_run(params, tokenizer, profile)` reads the journals (a torn last line cut off and reported),
counts what is done by `SampleKey.of(row)`, and lists the prompts still to send: templated (local)
or not yet (the HTTP engine templates each as it dispatches). With `turns: all` it replays each
conversation's journaled turns and plans its next one; `_take_turn` takes a turn's record into its
conversation and templates the next turn, or says why the conversation ended (`too_long` included).
A dataset with no usable prompt, or more rejected rows than it allows, stops the run here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from eagle3data.core.params import RunParams
from eagle3data.core.reader import SampleKey
from eagle3data.core.records import scan_journal
from eagle3data.generate.ledger import DatasetLedger
from eagle3data.generate.turns import Conversation, end_kind
from eagle3data.prompts.load import Prompt, PromptSet, load_datasets, template_prompt, template_prompts
from eagle3data.prompts.files import PromptDataError


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
        # a conversation's turns are replayed from their texts; otherwise only the keys, finish reasons and
        # bills are read, so resuming a run of 213M tokens holds none of its ids or texts
        scan = scan_journal(run_dir / "records" / f"{name}.jsonl", repair=True,
                            keep=None if modes[name] == "all" else PLAN_FIELDS)
        if scan.torn_tail_bytes:
            torn[name] = scan.torn_tail_bytes
        bad.extend(scan.bad_lines)
        if scan.records and not params.generate.resume:
            raise ValueError(f"{run_dir / 'records' / (name + '.jsonl')} already holds {len(scan.records)} records "
                             "and generate.resume is false: use a new run_name (journals are never rewritten)")
        all_turns = modes[name] == "all"
        if not all_turns:
            _drop_unsent(ps)
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


def _drop_unsent(ps: PromptSet) -> None:
    """turns: last: a prompt's request is its messages and tools; the source row's other turns
    (`conversation`) and card fields (`meta`, the dataset's own reply among them) are never sent nor
    journaled, so the plan drops them: at the seeds' 88,000 prompts they were most of what 01 held."""
    for p in ps.prompts:
        p.conversation = None
        p.meta = {}


# what the plan and the ledger read of a journaled record of a last-turn dataset (`DatasetLedger.add_record`)
PLAN_FIELDS = ("dataset", "sample_id", "turn", "finish_reason", "usage", "cost_usd", "source", "provider")


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
        elif ps.default_config and ps.config_note:  # a config the params do not name: say which was read
            print(f"prompts {d.name}: {ps.config_note}", flush=True)
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
