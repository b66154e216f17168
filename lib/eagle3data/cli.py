"""Command line: `python -m eagle3data run|status|stop|audit|export|prepare-model`.

`run` executes the stage notebooks headlessly with papermill into `outputs/<run>/notebooks/`
(each also saved as HTML), then renders `outputs/<run>/report.html`. It is what `make run`
calls; a notebook opened in JupyterLab runs the same code. While a stage runs, its live
progress line (from `outputs/<run>/progress.json`) is shown: refreshed in place on a
terminal, one line every `--progress-every` seconds otherwise.

Ctrl-C or SIGTERM on `run` stops like headless generate: the first writes the run folder's
`STOP` file (01 stops dispatching and lets the requests in flight finish and be journaled;
04 finishes the shard in progress), the stage ends cleanly and its notebook is saved, no
later stage starts, and it exits 3 with the command that resumes. A second signal cancels
the work in flight. `status RUN` says whether a run is alive and shows its ledger; `stop RUN`
is the graceful stop from another terminal.

User errors (params, missing model folder or key, a failing stage) are one line on stderr and
a non-zero exit; `--debug` shows the traceback.
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

from eagle3data.core.errors import UserInputError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STAGES = ["01_generate", "02_reconstruct", "03_audit", "04_extract_hidden", "05_export"]
STAGE_ALIASES = {s.split("_", 1)[0]: s for s in STAGES} | {s.split("_", 1)[1]: s for s in STAGES} | {
    "hidden": "04_extract_hidden", "extract": "04_extract_hidden"}
# stages that need the hidden-state pass; `hidden.enabled: false` leaves them out of a full run
HIDDEN_STAGES = {"04_extract_hidden"}


def resolve_stage(name: str) -> str:
    """`01`, `generate`, `01_generate` -> `01_generate`."""
    if name in STAGES:
        return name
    if name in STAGE_ALIASES:
        return STAGE_ALIASES[name]
    raise SystemExit(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")


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


# ------------------------------------------------------------------ checks before any work

from eagle3data.preflight import ready_problems  # noqa: E402  (kept importable from here)


def rejected_prompt_report(run_dir: Path, k: int = 3) -> list[str]:
    """From 01's ledger: per dataset with rejected prompt lines, the count and the first k (for the terminal)."""
    from eagle3data.generate.ledger import read_ledger

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
RUN_LOCK = "run.lock.json"  # the `run` command's own pid, stage and command line while it lives


class _KernelPids:
    """The pids of the kernels papermill starts (for the second signal, which interrupts them)."""

    pids: list[int] = []


def _tracked_kernel_manager():
    from jupyter_client.manager import AsyncKernelManager

    class TrackedKernelManager(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
            await super()._async_launch_kernel(kernel_cmd, **kw)
            pid = getattr(getattr(self.provisioner, "process", None), "pid", None)
            if pid:
                _KernelPids.pids.append(int(pid))

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
        from eagle3data.core.progress import read_progress

        p = read_progress(self.run_dir)
        if p and p.get("stage") == self.stage and float(p.get("updated_at") or 0) >= self.t0 and p.get("line"):
            return str(p["line"])
        return None

    def run(self) -> None:
        next_print = time.time() + self.every_s
        while not self._stop_event.wait(0.5):
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
    import papermill as pm

    from eagle3data.core.params import repo_root
    from eagle3data.audit.report import notebook_to_html

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
        from eagle3data.generate.ledger import read_ledger

        led = read_ledger(run_dir) or {}
        ds = (led.get("datasets") or {}).values()
        done, planned = sum(d.get("done", 0) for d in ds), sum(d.get("planned", 0) for d in ds)
        return str(led.get("status") or "stopped"), f"{done:,} of {planned:,} samples journaled"
    if stage == "04_extract_hidden":
        return "stopped", "finished shards kept"
    return "finished", "the stage completed"


def cmd_run(args: argparse.Namespace) -> int:
    from eagle3data.generate.run import CLI_RUN_ENV
    from eagle3data.core.params import load_params

    overrides = dict(args.p or [])
    params_file = Path(args.params).resolve()
    params = load_params(params_file, overrides)
    stages = [resolve_stage(s) for s in args.only] if args.only else list(STAGES)
    if not params.hidden.enabled and not args.only:
        stages = [s for s in stages if s not in HIDDEN_STAGES]
    problems = ready_problems(params, stages)
    if problems:
        raise UserError("; ".join(problems))
    run_dir = params.run_dir
    nb_dir = run_dir / "notebooks"
    out = sys.stdout
    tty = out.isatty() if args.progress_every is None else False
    every = float(args.progress_every or 30.0)
    lock = threading.RLock()

    def say(msg: str) -> None:
        with lock:
            out.write(("\r\x1b[K" if tty else "\n") + f"  {msg}\n")
            out.flush()

    run_dir.mkdir(parents=True, exist_ok=True)
    control = RunControl(run_dir, say)
    if control.stop_file.exists():  # left by an earlier run; a STOP written from now on is this run's
        control.stop_file.unlink()
        print(f"removed a STOP file left by an earlier run: {_shown_path(control.stop_file)}")
    lock_file = run_dir / RUN_LOCK
    os.environ[CLI_RUN_ENV] = "1"
    print(f"run {params.run_name!r} -> {_shown_path(run_dir)}")
    control.install()
    try:
        import orjson

        for n, stage in enumerate(stages):
            if control.reason is not None or control.external_stop():
                return _report_stop(args, control, stages[n:], run_dir, None)
            lock_file.write_bytes(orjson.dumps({"pid": os.getpid(), "stage": stage, "started_at": control.started,
                                                "argv": sys.argv}))
            t0 = time.perf_counter()
            out.write(f"  {stage} ...")
            out.flush()
            watch = StageWatch(run_dir, stage, out, tty, every, lock)
            watch.start()
            failed = None
            try:
                execute_notebook(stage, params_file, overrides, nb_dir)
            except Exception as e:  # noqa: BLE001 - papermill raises PapermillExecutionError with the cell's traceback
                failed = e
            finally:
                watch.finish()
            html = _shown_path(nb_dir / (stage + ".html"))
            took = f"{time.perf_counter() - t0:.0f} s"
            lead = f"  {stage}" if (tty or watch.printed) else ""
            if failed is not None and control.cancelled:
                print(f"{lead} cancelled after {took} -> {html}")
                return _report_stop(args, control, stages[n:], run_dir, stage)
            if failed is not None:
                print(f"{lead} FAILED after {took} -> {html}")
                if args.debug:
                    print(failed, file=sys.stderr)
                log = nb_dir / (stage + ".stderr.log")
                more = f"; kernel stderr: {_shown_path(log)}" if _log_has_news(log) else ""
                raise StageFailed(f"{stage} failed: {_cell_error(failed)}; executed notebook: "
                                f"{_shown_path(nb_dir / (stage + '.ipynb'))}{more}")
            control.external_stop()
            if control.reason is not None:
                status, _ = _stage_outcome(run_dir, stage)
                print(f"{lead} {status} after {took} -> {html}")
                if stage == "01_generate":
                    for line in rejected_prompt_report(run_dir):
                        print(line)
                if status == "finished" or stage not in ("01_generate", "04_extract_hidden"):
                    if n + 1 < len(stages):
                        return _report_stop(args, control, stages[n + 1:], run_dir, None)
                    break
                return _report_stop(args, control, stages[n:], run_dir, stage)
            print(f"{lead} done in {took} -> {html}")
            if stage == "01_generate":
                for line in rejected_prompt_report(run_dir):
                    print(line)
    finally:
        control.restore()
        os.environ.pop(CLI_RUN_ENV, None)
        lock_file.unlink(missing_ok=True)
        if control.reason is not None:
            control.stop_file.unlink(missing_ok=True)
    if "03_audit" in stages:
        from eagle3data.audit.report import render_report

        report = render_report(run_dir)
        print(f"report: {_shown_path(report)}")
    print(f"outputs: {_shown_path(run_dir)}")
    return 0


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
    from eagle3data.core.params import load_params, repo_root

    p = Path(run)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return load_params(p).run_dir
    for cand in (p, repo_root() / "outputs" / run, repo_root() / run):
        if cand.is_dir() and ((cand / "ledger.json").exists() or (cand / "records").is_dir()
                              or (cand / RUN_LOCK).exists()):
            return cand.resolve()
    raise UserError(f"no run folder {run!r} (give outputs/<run_name>, a run folder, or the run's params file)")


def _alive(pid: Any) -> bool:
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return False
    try:
        import psutil

        return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:  # noqa: BLE001 - psutil missing or the process went away meanwhile
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def _run_state(run_dir: Path) -> dict[str, Any]:
    """Who is working on the run: the `run` command's lock, the stage's progress.json, the ledger."""
    import orjson

    from eagle3data.generate.ledger import read_ledger
    from eagle3data.core.progress import read_progress

    lock = None
    if (run_dir / RUN_LOCK).exists():
        try:
            lock = orjson.loads((run_dir / RUN_LOCK).read_bytes())
        except (OSError, orjson.JSONDecodeError):
            lock = None
    prog = read_progress(run_dir)
    try:
        led = read_ledger(run_dir)
    except (OSError, ValueError):
        led = None
    pids = [x.get("pid") for x in (lock, prog) if x and x.get("pid")]
    live = [p for p in pids if _alive(p)]
    return {"lock": lock, "progress": prog, "ledger": led, "alive_pids": live,
            "running": bool(live) and (lock is not None or bool(prog and not prog.get("final")))}


def cmd_status(args: argparse.Namespace) -> int:
    from eagle3data.generate.ledger import ledger_frame

    run_dir = _find_run_dir(args.run)
    st = _run_state(run_dir)
    now = time.time()
    led, prog, lock = st["ledger"], st["progress"], st["lock"]
    if st["running"]:
        stage = (lock or {}).get("stage") or (prog or {}).get("stage")
        print(f"{_shown_path(run_dir)}: RUNNING ({stage}; process {', '.join(map(str, st['alive_pids']))} alive)")
    else:
        state = (led or {}).get("status")
        dead = state in ("running", "stopping")
        print(f"{_shown_path(run_dir)}: not running" + (
            f" (ledger says {state!r} but no process is alive: it was killed; re-run the same command to resume)"
            if dead else ""))
    if (run_dir / STOP_FILE).exists():
        print(f"STOP file present: {_shown_path(run_dir / STOP_FILE)} (a graceful stop is under way or pending)")
    if prog:
        age = now - float(prog.get("updated_at") or now)
        print(f"progress ({prog.get('stage')}, {age:.0f} s ago): {prog.get('line')}")
    if led:
        age = now - float(led.get("updated_at") or now)
        extra = f", stop reason: {led['stop_reason']}" if led.get("stop_reason") else ""
        print(f"ledger: status {led.get('status')!r}, updated {age:.0f} s ago{extra}")
        import pandas as pd

        with pd.option_context("display.width", 200, "display.max_columns", 30):
            print(ledger_frame(led).to_string())
    else:
        print("ledger: none yet (01_generate has not written one)")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    run_dir = _find_run_dir(args.run)
    st = _run_state(run_dir)
    stop_file = run_dir / STOP_FILE
    who = f"eagle3data stop from pid {os.getpid()}"
    if not stop_file.exists():
        stop_file.write_text(f"{who}\n")
    if not st["running"]:
        print(f"{_shown_path(run_dir)}: no live process; wrote {_shown_path(stop_file)} anyway "
              "(the next run removes it at its start)")
        return 1
    print(f"wrote {_shown_path(stop_file)}: the run starts no new work, lets what is in flight finish "
          f"and be journaled, then exits 3 (`eagle3data status {args.run}` to watch)")
    if args.now:
        from eagle3data.generate.ledger import read_ledger

        for _ in range(100):  # the stage notices the STOP file within its ledger interval
            led = read_ledger(run_dir) or {}
            if led.get("status") != "running":
                break
            time.sleep(0.1)
        pid = int(((st["lock"] or {}).get("pid")) or st["alive_pids"][0])
        os.kill(pid, signal.SIGINT)
        print(f"--now: sent SIGINT to pid {pid}: work in flight is cancelled (listed in the ledger, resent on resume)")
    return 0


def cmd_prompts(args: argparse.Namespace) -> int:
    from eagle3data.prompts.load import prompts_cli

    return prompts_cli(args.path, args.format, split=args.split, subset=args.subset, show=args.show, out=args.out)


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from eagle3data.core.models import prepare_embedded

    print(prepare_embedded(args.name, force=args.force))
    return 0


class UserError(UserInputError):
    """A problem the user can fix, said in one line (no traceback without --debug); exit status 2."""

    status = 2


class StageFailed(UserError):
    """A stage notebook raised; the line gives the cell's error and the executed notebook. Exit status 1."""

    status = 1


def cmd_generate(args: argparse.Namespace) -> int:
    """Stage 01 without papermill (what notebook 01 runs): preflight, generate, the ledger table."""
    from eagle3data.generate.run import run_generate  # the stage's stack (tokenizers, HTTP clients) only for this command
    from eagle3data.core.params import load_params

    params = load_params(args.params, dict(args.p or []))
    problems = ready_problems(params, ["01_generate"])
    if problems:
        raise UserError("; ".join(problems))
    s = run_generate(params, progress=not args.quiet)
    print(s.table().to_string())
    print(f"{s.status}: {s.new_records} new records in {s.seconds:.1f} s"
          + (f" ({s.stop_reason})" if s.stop_reason else ""))
    return 0 if s.status == "finished" else 3


def cmd_audit(args: argparse.Namespace) -> int:
    from eagle3data.audit.run import audit_cli

    return audit_cli(args.records, profile=args.profile, out=args.out, tokenizer=args.tokenizer,
                     allow_failed=args.allow_failed)


def cmd_export(args: argparse.Namespace) -> int:
    from eagle3data.export.run import export_cli

    return export_cli(args.run, fmt=args.format, out=args.out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eagle3data", description=__doc__.split("\n")[0])
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run the stage notebooks headlessly (papermill) for a params file")
    r.add_argument("params", help="params YAML, e.g. params/embedded.yaml")
    r.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"),
                   help="override a param by dotted key, e.g. -p generate.sampling.max_new_tokens 64")
    r.add_argument("--only", action="append", metavar="STAGE",
                   help="run only this stage (01/generate, 02, 03, 04, 05/export); repeatable")
    r.add_argument("--progress-every", type=float, metavar="SECONDS",
                   help="print the progress line every SECONDS on new lines (default: refreshed in place "
                        "on a terminal, every 30 s otherwise)")
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    r.set_defaults(func=cmd_run)

    st = sub.add_parser("status", help="is a run alive (process, last ledger update), its progress line and ledger")
    st.add_argument("run", help="run folder (outputs/<run_name>), run name, or the run's params file")
    st.set_defaults(func=cmd_status)

    sp = sub.add_parser("stop", help="stop a run gracefully from another terminal (writes its STOP file)")
    sp.add_argument("run", help="run folder (outputs/<run_name>), run name, or the run's params file")
    sp.add_argument("--now", action="store_true", help="also cancel the work in flight (a second signal)")
    sp.set_defaults(func=cmd_stop)

    g = sub.add_parser("generate", help="stage 01 headless, without papermill (exit 3 when stopped early)")
    g.add_argument("params", help="params YAML")
    g.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override a param")
    g.add_argument("--quiet", action="store_true", help="no progress line")
    g.set_defaults(func=cmd_generate)

    a = sub.add_parser("audit", help="audit a journal (JSONL) or columnar file; writes verdicts.jsonl, summary.json")
    a.add_argument("records", help="records JSONL (or .parquet)")
    a.add_argument("--profile", help="smollm2, qwen3, kimi-k2.5 (default: the profile the records name)")
    a.add_argument("--out", required=True, help="output folder")
    a.add_argument("--tokenizer", help="tokenizer folder (default: the run's own, from its recorded params)")
    a.add_argument("--allow-failed", action="store_true", help="exit 0 even when records fail a check")
    a.set_defaults(func=cmd_audit)

    e = sub.add_parser("export", help="export a run for a drafter trainer")
    e.add_argument("run", help="run folder, e.g. outputs/embedded")
    e.add_argument("--format", required=True, choices=["specforge", "speculators"])
    e.add_argument("--out", required=True, help="output folder")
    e.set_defaults(func=cmd_export)

    pr = sub.add_parser("prompts", help="show what a prompt dataset turns into (counts, rejected rows, examples)")
    pr.add_argument("path", help="file (.jsonl/.json/.parquet/.arrow), folder of shards, builtin:NAME or hf:NAME")
    pr.add_argument("--format", required=True, help="row format, e.g. sharegpt, ultrachat, glaive (README: Prompt datasets)")
    pr.add_argument("--split", help="split of a folder or hub dataset (default train)")
    pr.add_argument("--subset", help="config of a folder or hub dataset, e.g. all")
    pr.add_argument("--show", type=int, default=3, help="normalized examples to print")
    pr.add_argument("--out", help="write the normalized prompts here as format-prompts JSONL")
    pr.set_defaults(func=cmd_prompts)

    m = sub.add_parser("prepare-model", help="convert the embedded GGUF model into the safetensors cache")
    m.add_argument("name", nargs="?", default="smollm2")
    m.add_argument("--force", action="store_true")
    m.set_defaults(func=cmd_prepare_model)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error is one line on stderr (exit 2), `--debug` shows its traceback."""
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    try:
        return int(args.func(args) or 0)
    except UserInputError as e:  # every error a user can fix, in one line: its own status (2; a failed stage 1)
        if debug:
            raise
        print("error: " + " ".join(x.strip().lstrip("- ") for x in (str(e).strip() or type(e).__name__).splitlines()),
              file=sys.stderr)
        return e.status
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # not ours, but still one line (and exit 2)
        if debug:
            raise
        msg = str(e).strip() or type(e).__name__
        print(f"error: {type(e).__name__}: {msg.splitlines()[0]} (--debug for the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
