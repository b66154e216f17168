"""The run ledger: per dataset, what was planned, done, failed, skipped, cancelled, and what it cost.

`outputs/<run>/ledger.json` is rewritten atomically while 01_generate runs (so a crash
leaves the last good copy) and read by 03_audit. At the end of a run, for every dataset,
`done + errors + skipped + cancelled == planned` and `in_flight == 0`; the id lists say which
samples were never sent (`skipped_ids`) and which were in flight when work was cut
(`cancelled_ids`), so their lengths can be compared with the kept ones.

With `generate.turns: all` the counts are of turns (one record per turn): `planned` is the turns
reached so far (a conversation's next turn is planned when the turn before it is journaled),
and `conversations` / `conversation_ends` count conversations and how they ended, by reason
(done, max_turns, tool_call_mismatch, ..., budget, too_long); a conversation cut by a stop has
no end yet (`open`: it goes on at resume). Every reason but `budget` is also in the conversation's
last record (`conversation_end`); a `budget` end is counted here only (docs/01 "Turns").
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from eagle3data.core.atomic import write_atomic


@dataclass
class DatasetLedger:
    """Per-dataset counts: the damage assessment of a run, kept current while it runs."""

    planned: int = 0
    done: int = 0
    errors: int = 0
    skipped: int = 0
    cancelled: int = 0
    in_flight: int = 0
    resumed: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    budget_tokens: int | None = None
    budget_reached: bool = False
    by_source: dict[str, dict[str, float]] = field(default_factory=dict)
    by_provider: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped_ids: list[Any] = field(default_factory=list)
    cancelled_ids: list[Any] = field(default_factory=list)
    rejected_prompt_lines: list[str] = field(default_factory=list)
    conversations: int = 0
    conversation_ends: dict[str, int] = field(default_factory=dict)

    def end_conversation(self, reason: str) -> None:
        """Count one conversation that ended (turns: all), by the kind of its reason (`turns.end_kind`)."""
        kind = reason.split(":", 1)[0]
        self.conversation_ends[kind] = self.conversation_ends.get(kind, 0) + 1

    @property
    def conversations_open(self) -> int:
        """Conversations not ended (cut by a stop, or still running): they go on at resume."""
        return self.conversations - sum(self.conversation_ends.values())

    def add_record(self, rec: dict[str, Any]) -> None:
        """Count one journaled record (done or error) into the totals and the breakdowns."""
        usage = rec.get("usage") or {}
        pt = int(usage.get("prompt_tokens") or 0)
        ct = int(usage.get("completion_tokens") or 0)
        cost = float(rec.get("cost_usd") or 0.0)
        err = rec.get("finish_reason") == "error"
        if err:
            self.errors += 1
        else:
            self.done += 1
        self.prompt_tokens += pt
        self.completion_tokens += ct
        self.cost_usd += cost
        for key, book in ((rec.get("source") or "?", self.by_source), (rec.get("provider"), self.by_provider)):
            if key is None:
                continue
            row = book.setdefault(key, {"done": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                        "cost_usd": 0.0})
            row["errors" if err else "done"] += 1
            row["prompt_tokens"] += pt
            row["completion_tokens"] += ct
            row["cost_usd"] += cost

    def remove_error(self, rec: dict[str, Any]) -> None:
        """Take a journaled error record out of the counts (it is being retried)."""
        self.errors -= 1
        for key, book in ((rec.get("source") or "?", self.by_source), (rec.get("provider"), self.by_provider)):
            if key is not None and key in book:
                book[key]["errors"] -= 1

    def skip(self, sample_id: Any) -> None:
        """Count a sample that was never sent (budget, stop, rejected prompt)."""
        self.skipped += 1
        self.skipped_ids.append(sample_id)

    def reject(self, sample_id: Any, line: str, *, turn: bool = False) -> None:
        """Count a prompt that is not sent because it is unusable (it reaches model.max_context): skipped, its
        reason line kept; a conversation's turn also ends the conversation (`too_long`)."""
        self.skip(sample_id)
        self.rejected_prompt_lines.append(line)
        if turn:
            self.end_conversation("too_long")

    def cancel(self, sample_id: Any) -> None:
        """Count a sample whose work was cut while in progress."""
        self.cancelled += 1
        self.cancelled_ids.append(sample_id)

    def tokens(self, counts: str = "total") -> int:
        """Tokens counted against the budget: prompt+completion, or completion only."""
        return self.completion_tokens + (self.prompt_tokens if counts == "total" else 0)


def write_ledger(run_dir: Path, ledger: dict[str, DatasetLedger], status: str, extra: dict | None = None) -> None:
    """Write `ledger.json` atomically (write a temp file, then rename)."""
    data: dict[str, Any] = {"status": status, "updated_at": time.time(),
                            "datasets": {k: asdict(v) for k, v in ledger.items()}}
    if extra:
        data.update(extra)
    write_atomic(Path(run_dir) / "ledger.json", orjson.dumps(data, option=orjson.OPT_INDENT_2))


def read_ledger(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's ledger.json as a dict, or None when the run has none yet."""
    p = Path(run_dir) / "ledger.json"
    return orjson.loads(p.read_bytes()) if p.exists() else None


def ledger_frame(ledger: dict[str, Any] | dict[str, DatasetLedger] | None):
    """The one ledger table: per dataset planned, done, errors, skipped, cancelled, tokens, cost, and `missing`.

    `missing` = planned - done - errors - skipped - cancelled - in_flight: zero when every planned
    sample is accounted for (a run stopped by kill -9 shows its lost work here).
    """
    import pandas as pd

    cols = ("planned", "done", "resumed", "errors", "skipped", "cancelled", "in_flight", "retries",
            "prompt_tokens", "completion_tokens", "cost_usd", "budget_tokens", "budget_reached")
    if not ledger:
        return pd.DataFrame(columns=[*cols, "missing"]).rename_axis("dataset")
    datasets = ledger.get("datasets", ledger) if isinstance(ledger, dict) else ledger
    rows = []
    for name, v in datasets.items():
        d = asdict(v) if isinstance(v, DatasetLedger) else v
        rows.append({"dataset": name, **{c: d.get(c) for c in cols}})
    df = pd.DataFrame(rows).set_index("dataset")
    acc = df[["done", "errors", "skipped", "cancelled", "in_flight"]].fillna(0).sum(axis=1)
    df["missing"] = (df["planned"].fillna(0) - acc).astype(int)
    convs = {name: (asdict(v) if isinstance(v, DatasetLedger) else v) for name, v in datasets.items()}
    if any(d.get("conversations") for d in convs.values()):  # turns: all: the counts above are turns
        df["conversations"] = [int(convs[n].get("conversations") or 0) for n in df.index]
        df["ended"] = [sum((convs[n].get("conversation_ends") or {}).values()) for n in df.index]
        df["ends"] = [", ".join(f"{k} {v}" for k, v in sorted((convs[n].get("conversation_ends") or {}).items()))
                      for n in df.index]
    return df


def provider_frame(ledger: dict[str, Any] | dict[str, DatasetLedger]):
    """One row per (dataset, source or provider): done, errors, tokens, cost."""
    import pandas as pd

    datasets = ledger.get("datasets", ledger) if isinstance(ledger, dict) else ledger
    rows = []
    for name, v in datasets.items():
        d = asdict(v) if isinstance(v, DatasetLedger) else v
        for kind in ("by_source", "by_provider"):
            for key, row in (d.get(kind) or {}).items():
                rows.append({"dataset": name, "by": kind[3:], "name": key, **row})
    return pd.DataFrame(rows)
