"""Live progress of a long stage: one line for the notebook and the terminal, and `progress.json`.

A stage that runs for long (01 generate, 04 extract) calls `Progress.update(line, figures)`
every second or so. The line shows in place in a notebook (a display handle), on a
terminal (a carriage-return line on stderr) or in a log (a line every 10 s). Each update is
also written atomically to `outputs/<run>/progress.json` (stage, pid, line, figures, time),
which `eagle3data run` reads to show the same line while the stage runs inside papermill,
and `eagle3data status` reads to say whether the run is alive.

`generate_line` builds 01's line from the ledger: done / planned (overall and per dataset),
the share done (a dataset with a token budget counts its tokens against the budget, since it
stops there, not at its planned count), rate, tokens against the budgets, dollars against the
cost cap, credit left, elapsed time and ETA.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import orjson

from eagle3data.core.atomic import write_atomic

PROGRESS_FILE = "progress.json"


def fmt_duration(seconds: float | None) -> str:
    """`0:04:07`, `12:30:00`; `?` when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def fmt_tokens(n: float) -> str:
    """`950`, `12.3k`, `4.56M`, `1.20B`."""
    n = float(n)
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}" if n / div < 100 else f"{n / div:.0f}{unit}"
    return f"{n:.0f}"


def _get(d: Any, key: str, default: Any = 0) -> Any:
    if isinstance(d, Mapping):
        v = d.get(key, default)
    else:
        v = getattr(d, key, default)
    return default if v is None else v


def remaining_samples(d: Any, counts: str = "total") -> float:
    """Samples a dataset will still produce: its unsettled ones, or fewer when its token budget ends it first."""
    planned = _get(d, "planned")
    settled = _get(d, "done") + _get(d, "errors") + _get(d, "skipped") + _get(d, "cancelled")
    left = max(0, planned - settled - _get(d, "in_flight"))
    if _get(d, "budget_reached", False):
        return 0.0
    budget = _get(d, "budget_tokens", None)
    done = _get(d, "done") + _get(d, "errors")
    if budget and done:
        used = _get(d, "completion_tokens") + (_get(d, "prompt_tokens") if counts == "total" else 0)
        per_sample = used / done if used else 0
        if per_sample:
            left = min(left, max(0.0, (budget - used) / per_sample))
    return float(left)


def generate_figures(ledger: Mapping[str, Any], *, counts: str = "total", elapsed_s: float = 0.0,
                     session_done: int = 0, cost_cap_usd: float | None = None,
                     credit_left_usd: float | None = None, in_flight: int = 0,
                     rate_rps: float | None = None, tokens_per_s: float | None = None,
                     stop_reason: str | None = None) -> dict[str, Any]:
    """The figures of 01's progress line (also written to progress.json and shown by `status`)."""
    done = sum(_get(d, "done") for d in ledger.values())
    errors = sum(_get(d, "errors") for d in ledger.values())
    planned = sum(_get(d, "planned") for d in ledger.values())
    left = sum(remaining_samples(d, counts) for d in ledger.values())
    used = sum(_get(d, "completion_tokens") + (_get(d, "prompt_tokens") if counts == "total" else 0)
               for d in ledger.values())
    budgets = [_get(d, "budget_tokens", None) for d in ledger.values()]
    budget = sum(budgets) if budgets and all(budgets) else None
    spent = sum(float(_get(d, "cost_usd", 0.0)) for d in ledger.values())
    per_s = session_done / elapsed_s if elapsed_s > 0 and session_done else None
    eta = left / per_s if per_s else (0.0 if left == 0 else None)
    share = (done + errors) / (done + errors + left) if (done + errors + left) else 1.0
    return {
        "done": done, "errors": errors, "planned": planned, "left": round(left, 1), "share": round(share, 4),
        "tokens": used, "token_budget": budget, "cost_usd": round(spent, 6), "cost_cap_usd": cost_cap_usd,
        "credit_left_usd": credit_left_usd, "in_flight": in_flight, "elapsed_s": round(elapsed_s, 1),
        "eta_s": None if eta is None else round(eta, 1), "samples_per_s": per_s if per_s is None else round(per_s, 3),
        "requests_per_s": rate_rps, "tokens_per_s": tokens_per_s, "stop_reason": stop_reason,
        "datasets": {name: {"done": _get(d, "done"), "planned": _get(d, "planned"),
                            "budget_tokens": _get(d, "budget_tokens", None),
                            "tokens": _get(d, "completion_tokens") + (_get(d, "prompt_tokens") if counts == "total" else 0)}
                     for name, d in ledger.items()},
    }


def generate_line(f: Mapping[str, Any], *, final: bool = False) -> str:
    """01's one-line status from `generate_figures`: totals first, per dataset last (a narrow terminal cuts those)."""
    parts = [f"generate {f['done']:,}/{f['planned']:,}"
             + ("" if f.get("stop_reason") else f" ({100 * f['share']:.1f}%)")]
    if f.get("requests_per_s") is not None:
        parts.append(f"{f['requests_per_s']:,.1f} req/s")
    elif f.get("samples_per_s") is not None:
        parts.append(f"{f['samples_per_s']:,.2f} samples/s")
    if f.get("tokens_per_s") is not None:
        parts.append(f"{f['tokens_per_s']:,.0f} tok/s")
    tok = f"{fmt_tokens(f['tokens'])} tok"
    if f.get("token_budget"):
        tok = f"{fmt_tokens(f['tokens'])}/{fmt_tokens(f['token_budget'])} tok"
    parts.append(tok)
    if f.get("cost_usd") or f.get("cost_cap_usd"):
        cap = f"/${f['cost_cap_usd']:,.2f}" if f.get("cost_cap_usd") else ""
        parts.append(f"${f['cost_usd']:,.4f}{cap}")
    if f.get("credit_left_usd") is not None:
        parts.append(f"credit ${f['credit_left_usd']:,.2f}")
    parts.append(f"elapsed {fmt_duration(f['elapsed_s'])}")
    if not final:
        parts.append(f"ETA {fmt_duration(f.get('eta_s'))}")
    if f.get("errors"):
        parts.append(f"{f['errors']:,} err")
    if f.get("in_flight"):
        parts.append(f"{f['in_flight']:,} in flight")
    if f.get("stop_reason"):
        parts.append(f"stopping: {f['stop_reason']}" if not final else f"stopped: {f['stop_reason']}")
    ds = f.get("datasets") or {}
    if len(ds) > 1:
        cells = []
        for name, d in ds.items():
            cell = f"{name} {d['done']:,}/{d['planned']:,}"
            if d.get("budget_tokens"):
                cell += f" ({100 * min(1.0, d['tokens'] / d['budget_tokens']):.0f}% of budget)"
            cells.append(cell)
        parts.append(" ".join(cells))
    return " · ".join(parts)


def write_progress(run_dir: Path, stage: str, line: str, figures: Mapping[str, Any] | None = None,
                   final: bool = False) -> None:
    """Write `progress.json` atomically (a temp file, then rename)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    data = {"stage": stage, "pid": os.getpid(), "updated_at": time.time(), "final": final, "line": line,
            "figures": dict(figures or {})}
    try:
        write_atomic(run_dir / PROGRESS_FILE, orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY, default=str),
                     tmp_suffix=f".{os.getpid()}.tmp")
    except OSError:
        pass  # progress is for watching; a full disk must not stop the stage here


def read_progress(run_dir: Path) -> dict[str, Any] | None:
    """The run's progress.json, or None (absent, or caught mid-rename)."""
    p = Path(run_dir) / PROGRESS_FILE
    try:
        return orjson.loads(p.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


class Progress:
    """A live one-line status: a display handle in a notebook, a carriage-return line in a terminal.

    With `run_dir`, every update also goes to `progress.json` (whether or not it is shown).
    """

    def __init__(self, enabled: bool = True, *, run_dir: Path | None = None, stage: str = "01_generate",
                 every_s: float = 10.0):
        self.enabled = enabled
        self.run_dir = run_dir
        self.stage = stage
        self.every_s = every_s
        self._handle = None
        self._tty = sys.stderr.isatty()
        self._last_print = 0.0
        if not enabled:
            return
        try:
            from IPython import get_ipython

            ip = get_ipython()
            if ip is not None and getattr(ip, "kernel", None) is not None:
                from IPython.display import display

                self._handle = display({"text/plain": f"{stage}: starting"}, raw=True, display_id=True)
        except ImportError:
            pass

    def update(self, line: str, final: bool = False, figures: Mapping[str, Any] | None = None) -> None:
        if self.run_dir is not None:
            write_progress(self.run_dir, self.stage, line, figures, final)
        if not self.enabled:
            return
        if self._handle is not None:
            self._handle.update({"text/plain": line}, raw=True)
        elif self._tty:
            sys.stderr.write("\r" + line.ljust(120)[:200] + ("\n" if final else ""))
            sys.stderr.flush()
        elif final or time.monotonic() - self._last_print > self.every_s:
            self._last_print = time.monotonic()
            print(line, file=sys.stderr, flush=True)


def capture_line(head: str, tokens: int, total_tokens: int, failed: int, in_flight: int, elapsed: float,
                 *, final: bool = False, stop_reason: str | None = None) -> tuple[str, float | None]:
    """04's line while an engine captures (vLLM, SGLang's passes): `head` (samples done), tokens against the
    plan, rate, failures, requests in flight, elapsed, ETA; and the rate it shows (tokens/s, None before any)."""
    rate = tokens / elapsed if elapsed > 0 and tokens else None
    parts = [head, f"{fmt_tokens(tokens)}/{fmt_tokens(total_tokens)} tok"]
    if rate:
        parts.append(f"{rate:,.0f} tok/s")
    parts += [f"failed {failed}", f"in flight {in_flight}", f"elapsed {fmt_duration(elapsed)}"]
    if not final and rate:
        parts.append(f"ETA {fmt_duration((total_tokens - tokens) / rate)}")
    if stop_reason:
        parts.append(f"stopped: {stop_reason}")
    return " · ".join(parts), rate
