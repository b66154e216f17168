"""The headless notebook runner behind `python -m eagle3data run|status|stop`.

`execute_notebook` runs one stage notebook through papermill into `outputs/<run>/notebooks/`
(each also saved as HTML), with the kernel's own stderr kept in the stage's log beside it
(`_kernel_stderr_to`). While a stage runs, `StageWatch` shows its live progress line (from
`outputs/<run>/progress.json`): refreshed in place on a terminal, one line every
`--progress-every` seconds otherwise.

Ctrl-C or SIGTERM on `run` stops like headless generate (`RunControl`): the first writes the run
folder's `STOP` file (01 stops dispatching and lets the requests in flight finish and be
journaled; 04 finishes the shard in progress), the stage ends cleanly and its notebook is saved,
no later stage starts, and it exits 3 with the command that resumes (`_report_stop`). A second
signal cancels the work in flight. `status RUN` and `stop RUN` find the run (`_find_run_dir`) and
who is working on it (`_run_state`: the writer's record in `run.lock.json`, the stage's progress line, the ledger).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TextIO

from eagle3data.audit.report import notebook_to_html
from eagle3data.core.errors import UserInputError
from eagle3data.core.params import load_params, repo_root
from eagle3data.core.progress import read_progress
from eagle3data.core.runlock import RUN_LOCK, pid_alive, read_lock
from eagle3data.generate.ledger import read_ledger


class NoRunFolder(UserInputError):
    """`status`/`stop` were given no run folder, run name or params file of a run; exit status 2."""


# Lines the kernel process prints on every start that say nothing about the run.
KERNEL_NOISE = ("Kernel is running over TCP without encryption",)


@contextmanager
def _kernel_stderr_to(log: Path) -> Iterator[None]:
    """Send the stderr of the kernel process (and papermill's own) to `log` while a stage runs.

    What a stage says (its progress, warnings, a failing cell's error) reaches the user through the
    notebook, the progress line and the one-line error; the kernel's own stderr holds its start-up
    warning and, at shutdown after a stop, the tracebacks of its dying zmq threads. Kept in the stage's
    log beside its notebook, they never break the one-line promise; a failure names the log."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _log_has_news(log: Path) -> bool:
    """The stage log holds a line other than the kernel's start-up warning."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return False
    return any(line.strip() and not any(n in line for n in KERNEL_NOISE) for line in lines)


def rejected_prompt_report(run_dir: Path, k: int = 3) -> list[str]:
    """From 01's ledger: per dataset with rejected prompt lines, the count and the first k (for the terminal)."""
    try:
        led = read_ledger(run_dir) or {}
    except Exception:  # noqa: BLE001 - a report line, never a reason to fail a finished stage
        return []
    out = []
    for name, d in (led.get("datasets") or {}).items():
        rej = list((d or {}).get("rejected_prompt_lines") or [])
        if not rej:
            continue
        out.append(f"  {name}: {len(rej)} prompt line(s) rejected when read (never sent):")
        out += [f"    {x}" for x in rej[:k]]
        if len(rej) > k:
            out.append(f"    ... and {len(rej) - k} more: rejected_prompt_lines in {_shown_path(run_dir / 'ledger.json')}")
    return out


# ------------------------------------------------------------------ stopping a run

STOP_FILE = "STOP"


class _KernelPids:
    """The kernels papermill starts: their pids (for the second signal, which interrupts them), their processes
    (a dead kernel's exit signal) and the memory last measured of each (`StageWatch` samples it)."""

    pids: list[int] = []
    procs: dict[int, Any] = {}
    rss: dict[int, tuple[int, int, float]] = {}  # pid -> (last RSS, peak RSS, when last measured)

    @classmethod
    def sample(cls) -> None:
        """Measure the RSS of the latest kernel (psutil; nothing when it is gone)."""
        if not cls.pids:
            return
        import psutil

        pid = cls.pids[-1]
        try:
            rss = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return
        if rss == 0:  # a killed kernel not yet reaped (a zombie) holds no memory: keep what it held before
            return
        cls.rss[pid] = (rss, max(rss, cls.rss.get(pid, (0, 0, 0.0))[1]), time.time())


# The setting that bounds each stage's memory: named when its kernel is killed (issue 59).
MEMORY_SETTING = {
    "01_generate": "generate.concurrency (requests in flight)",
    "02_reconstruct": "reconstruct.batch_size (records rebuilt per chunk)",
    "03_audit": "audit.chunk_records (records checked per chunk)",
    "04_extract_hidden": "hidden.batch_tokens (tokens per forward batch) and hidden.shard_bytes",
    "05_export": "export.chunk_rows (rows written per chunk)",
    "06_value": "value.train.batch_size",
}


def kernel_death(stage: str, error: BaseException) -> str | None:
    """Why a stage's kernel died, in one line: its exit signal, that the out-of-memory killer is the usual sender
    of SIGKILL, the memory last measured and the setting that bounds it; None when the error is not a dead kernel."""
    dead = type(error).__name__ == "DeadKernelError" or "Kernel died" in str(error)  # also before kernel_info's reply
    if not dead or not _KernelPids.pids:
        return None
    pid = _KernelPids.pids[-1]
    proc = _KernelPids.procs.get(pid)
    code = None
    if proc is not None:
        try:
            code = proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - the reason line must not fail: say what is known
            code = getattr(proc, "returncode", None)
    if code is not None and code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    elif code is not None:
        how = f"exited with status {code}"
    else:
        how = "gone"
    line = f"{stage}'s kernel (pid {pid}) died: {how}"
    if code == -signal.SIGKILL:
        line += " (the system's out-of-memory killer is the usual sender of SIGKILL: `dmesg | grep -i oom` says)"
    last = _KernelPids.rss.get(pid)
    if last:
        total = _total_memory()
        of = f" of the machine's {total / 2**30:.1f} GiB" if total else ""
        line += (f"; its memory last measured {time.time() - last[2]:.0f} s before: {last[0] / 2**30:.2f} GiB"
                 f"{of} (peak {last[1] / 2**30:.2f} GiB)")
    if stage in MEMORY_SETTING:
        line += f"; the setting that bounds it: {MEMORY_SETTING[stage]}"
    return line


def _total_memory() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001
        return None


def _tracked_kernel_manager():
    from jupyter_client.manager import AsyncKernelManager  # papermill's kernel client: only when a notebook runs

    class TrackedKernelManager(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
            await super()._async_launch_kernel(kernel_cmd, **kw)
            proc = getattr(self.provisioner, "process", None)
            pid = getattr(proc, "pid", None)
            if pid:
                _KernelPids.pids.append(int(pid))
                _KernelPids.procs[int(pid)] = proc

    return TrackedKernelManager


class RunControl:
    """SIGINT/SIGTERM for `run`: the first writes the STOP file, a second interrupts the kernel.

    The kernel runs in its own session (jupyter_client starts it so), so a terminal's Ctrl-C
    reaches only this process; the stage sees the stop through the STOP file, which 01's
    engines and 04's shard loop poll, and a second signal is passed on as SIGINT to the
    kernel, where generate's handlers cancel what is in flight.
    """

    def __init__(self, run_dir: Path, say: Any):
        self.run_dir = run_dir
        self.say = say
        self.reason: str | None = None
        self.cancelled = False
        self.started = time.time()
        self._previous: dict[int, Any] = {}

    @property
    def stop_file(self) -> Path:
        return self.run_dir / STOP_FILE

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self.on_signal)

    def restore(self) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)
        self._previous.clear()

    def external_stop(self) -> bool:
        """A STOP file written since the run started (`eagle3data stop`, `touch STOP`)."""
        if self.reason is None and self.stop_file.exists():
            try:
                text = self.stop_file.read_text(errors="replace").strip().splitlines()
            except OSError:
                text = []
            self.reason = (text[0] if text and text[0].strip() else "STOP file") + " (STOP file)"
        return self.reason is not None

    def on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.reason is None and not self.stop_file.exists():
            self.reason = f"{name} received by eagle3data run"
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self.stop_file.write_text(f"{self.reason}\npid {os.getpid()} at {time.ctime()}\n")
            except OSError:
                pass
            self.say(f"stopping ({name}): no new work is started; the work in flight finishes and is kept. "
                     f"{name} again cancels it")
            return
        self.external_stop()
        if not self.cancelled:
            self.cancelled = True
            self.reason = f"{self.reason}; second {name}: work in flight cancelled"
            self.say(f"second {name}: cancelling the work in flight")
        for pid in _KernelPids.pids:
            try:
                os.kill(pid, signal.SIGINT)
            except OSError:
                pass


class StageWatch(threading.Thread):
    """Shows a stage's live progress line (progress.json) while papermill runs it.

    On a terminal one line is refreshed in place (stages without a progress line show their
    elapsed time); otherwise the latest line is printed every `every_s` seconds.
    """

    def __init__(self, run_dir: Path, stage: str, out: TextIO, tty: bool, every_s: float, lock: threading.RLock):
        super().__init__(name=f"watch-{stage}", daemon=True)
        self.run_dir, self.stage, self.out, self.tty, self.every_s = run_dir, stage, out, tty, every_s
        self.lock = lock
        self.t0 = time.time()
        self.printed = 0  # progress lines printed (non-terminal)
        self.last_line: str | None = None
        self.last_printed: str | None = None
        self._stop_event = threading.Event()

    def current(self) -> str | None:
        p = read_progress(self.run_dir)
        if p and p.get("stage") == self.stage and float(p.get("updated_at") or 0) >= self.t0 and p.get("line"):
            return str(p["line"])
        return None

    def run(self) -> None:
        next_print = time.time() + self.every_s
        while not self._stop_event.wait(0.5):
            _KernelPids.sample()
            line = self.current()
            if line:
                self.last_line = line
            with self.lock:
                if self.tty:
                    shown = line or f"{self.stage} ... {time.time() - self.t0:.0f} s"
                    width = shutil.get_terminal_size((120, 20)).columns
                    self.out.write("\r\x1b[K  " + shown[: max(20, width - 3)])
                    self.out.flush()
                elif line and line != self.last_printed and time.time() >= next_print:
                    next_print = time.time() + self.every_s
                    self.out.write(("\n" if not self.printed else "") + f"    {line}\n")
                    self.out.flush()
                    self.printed += 1
                    self.last_printed = line

    def finish(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
        line = self.current()
        if line:
            self.last_line = line
        with self.lock:
            if self.tty:
                self.out.write("\r\x1b[K")
            elif self.printed and self.last_line and self.last_line != self.last_printed:
                self.out.write(f"    {self.last_line}\n")
            self.out.flush()


def execute_notebook(stage: str, params_file: Path, overrides: dict[str, str], out_dir: Path) -> Path:
    """Run one stage notebook through papermill; save the executed copy and its HTML."""
    import papermill as pm  # heavy and optional for the rest of the CLI: only when a notebook runs

    src = repo_root() / "notebooks" / f"{stage}.ipynb"
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{stage}.ipynb"
    try:
        with _kernel_stderr_to(out_dir / f"{stage}.stderr.log"):
            pm.execute_notebook(
                str(src), str(dst),
                parameters={"params_file": str(params_file), "overrides": overrides},
                kernel_name="python3", cwd=str(repo_root()), progress_bar=False, log_output=False,
                kernel_manager_class=_tracked_kernel_manager(),
            )
    finally:
        if dst.exists():
            notebook_to_html(dst, dst.with_suffix(".html"))
    return dst


def _shown_path(p: Path) -> str:
    """A path relative to the working directory when it is under it (as a user typed it)."""
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def _resume_command(args: argparse.Namespace, stages: list[str]) -> str:
    cmd = ["python", "-m", "eagle3data", "run", args.params]
    for k, v in args.p or []:
        cmd += ["-p", k, v]
    for st in stages:
        cmd += ["--only", st.split("_", 1)[0]]
    return shlex.join(cmd)


def _stage_outcome(run_dir: Path, stage: str) -> tuple[str, str]:
    """(status, summary) of a stage that ended after a stop request."""
    if stage == "01_generate":
        led = read_ledger(run_dir) or {}
        ds = (led.get("datasets") or {}).values()
        done, planned = sum(d.get("done", 0) for d in ds), sum(d.get("planned", 0) for d in ds)
        return str(led.get("status") or "stopped"), f"{done:,} of {planned:,} samples journaled"
    if stage == "04_extract_hidden":
        return "stopped", "finished shards kept"
    if stage == "06_value":
        return "stopped", "finished variants, built data and the training checkpoint kept"
    return "finished", "the stage completed"


def _cell_error(e: BaseException) -> str:
    """`ename: evalue` of a failed cell (PapermillExecutionError), first line only."""
    ename, evalue = getattr(e, "ename", None), getattr(e, "evalue", None)
    text = f"{ename}: {evalue}" if ename else f"{type(e).__name__}: {e}"
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def _report_stop(args: argparse.Namespace, control: RunControl, left: list[str], run_dir: Path,
                 stage: str | None) -> int:
    """The one line a stopped run ends with (what was kept, how to resume); exit status 3."""
    if stage is not None:
        status, kept = _stage_outcome(run_dir, stage)
        what = f"{stage} {status} ({kept}; ledger and executed notebook saved)"
    else:
        what = "no further stage started"
    print(f"stopped: {control.reason}; {what}. Resume: {_resume_command(args, left)}", file=sys.stderr)
    return 3


# ------------------------------------------------------------------ status and stop from another terminal

def _find_run_dir(run: str) -> Path:
    """A run folder from `outputs/NAME`, a folder path, a run name, or the params file of the run."""
    p = Path(run)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return load_params(p).run_dir
    for cand in (p, repo_root() / "outputs" / run, repo_root() / run):
        if cand.is_dir() and ((cand / "ledger.json").exists() or (cand / "records").is_dir()
                              or (cand / RUN_LOCK).exists()):
            return cand.resolve()
    raise NoRunFolder(f"no run folder {run!r} (give outputs/<run_name>, a run folder, or the run's params file)")


def _run_state(run_dir: Path) -> dict[str, Any]:
    """Who is working on the run: the writer's record (`run.lock.json`, read, never locked), progress.json, the ledger."""
    lock = read_lock(run_dir)
    prog = read_progress(run_dir)
    try:
        led = read_ledger(run_dir)
    except (OSError, ValueError):
        led = None
    pids = [x.get("pid") for x in (lock, prog) if x and x.get("pid")]
    live = [p for p in pids if pid_alive(p)]
    return {"lock": lock, "progress": prog, "ledger": led, "alive_pids": live,
            "running": bool(live) and (lock is not None or bool(prog and not prog.get("final")))}

