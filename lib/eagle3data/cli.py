"""Command line: `python -m eagle3data run|status|stop|generate|extract|verify-hidden|audit|export|prompts|prepare-model`.

`run` executes the stage notebooks headlessly with papermill (`headless.py`: the executed
notebooks and their HTML under `outputs/<run>/notebooks/`, the live progress line, a graceful
stop on Ctrl-C/SIGTERM with exit 3 and the command that resumes), then renders
`outputs/<run>/report.html`; it is what `make run` calls. `status RUN` says whether a run is
alive and shows its ledger; `stop RUN` is the graceful stop from another terminal.
`generate` and `extract` run stages 01 and 04 without papermill; `extract` is also what each
worker runs under `torchrun --nproc-per-node N -m eagle3data extract PARAMS`.

User errors (params, a missing model folder or key, a failing stage): every one derives from
`core.errors.UserInputError` and is mapped to one line on stderr and its exit status (2; a failed
stage 1) in one place, `main`; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from eagle3data.audit.report import render_report
from eagle3data.core.errors import UserInputError
from eagle3data.core.params import load_params
from eagle3data.core.profiles import get_profile
from eagle3data.core.runlock import LAUNCH_ENV, hold_run, new_launch_id
from eagle3data.generate.ledger import ledger_frame, read_ledger
from eagle3data.headless import (STOP_FILE, RunControl, StageWatch, _cell_error, _find_run_dir,
                                 _log_has_news, _report_stop, _run_state, _shown_path, _stage_outcome,
                                 execute_notebook, kernel_death, rejected_prompt_report)
from eagle3data.preflight import ready_problems

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STAGES = ["01_generate", "02_reconstruct", "03_audit", "04_extract_hidden", "05_export", "06_value"]
STAGE_ALIASES = {s.split("_", 1)[0]: s for s in STAGES} | {s.split("_", 1)[1]: s for s in STAGES} | {
    "hidden": "04_extract_hidden", "extract": "04_extract_hidden"}
# stages that need the hidden-state pass; `hidden.enabled: false` leaves them out of a full run
HIDDEN_STAGES = {"04_extract_hidden"}
# A stage that stops itself on the STOP file raises one of these in its notebook (06: value.train.ValueStopped's kinds)
STOPPED = {"ValueStopped", "TrainingStopped", "EvalStopped"}


def resolve_stage(name: str) -> str:
    """`01`, `generate`, `01_generate` -> `01_generate`."""
    if name in STAGES:
        return name
    if name in STAGE_ALIASES:
        return STAGE_ALIASES[name]
    raise UserError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")


class UserError(UserInputError):
    """A problem the user can fix, said in one line (no traceback without --debug); exit status 2."""

    status = 2


class StageFailed(UserError):
    """A stage notebook raised; the line gives the cell's error and the executed notebook. Exit status 1."""

    status = 1


STAGE_TIMES = "stage_times.json"  # <run>/stage_times.json: each stage's last completed `run`, as printed


def _record_stage_time(run_dir: Path, stage: str, took: str) -> None:
    """Keep the stage's wall time as `run` printed it (`N s`, kernel start included), for `tools/readme_run.py`."""
    import json

    from eagle3data.core.atomic import write_atomic

    path = run_dir / STAGE_TIMES
    try:
        times = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        times = {}
    times[stage] = int(took.split()[0])
    write_atomic(path, json.dumps(times, indent=1).encode())


def cmd_run(args: argparse.Namespace) -> int:
    from eagle3data.generate.run import CLI_RUN_ENV  # 01's module (its HTTP stack) only when `run` runs

    overrides = dict(args.p or [])
    params_file = Path(args.params).resolve()
    params = load_params(params_file, overrides)
    stages = [resolve_stage(s) for s in args.only] if args.only else list(STAGES)
    if not params.hidden.enabled and not args.only:
        stages = [s for s in stages if s not in HIDDEN_STAGES]
    if not params.value.enabled and not args.only:  # 06 trains drafts: only when the params ask (`value.enabled`)
        stages = [s for s in stages if s != "06_value"]
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

    os.environ[LAUNCH_ENV] = new_launch_id()  # the kernels it starts are of this launch: they join its hold
    try:
        hold = hold_run(run_dir, stages[0], say=print)  # a second writer stops here, before any work
    except BaseException:
        os.environ.pop(LAUNCH_ENV, None)
        raise
    control = RunControl(run_dir, say)
    if control.stop_file.exists():  # left by an earlier run; a STOP written from now on is this run's
        control.stop_file.unlink()
        print(f"removed a STOP file left by an earlier run: {_shown_path(control.stop_file)}")
    os.environ[CLI_RUN_ENV] = "1"
    print(f"run {params.run_name!r} -> {_shown_path(run_dir)}")
    control.install()
    try:
        for n, stage in enumerate(stages):
            if control.reason is not None or control.external_stop():
                return _report_stop(args, control, stages[n:], run_dir, None)
            hold.set_stage(stage)
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
            if failed is not None and control.reason is not None and getattr(failed, "ename", None) in STOPPED:
                print(f"{lead} stopped after {took} -> {html}")  # the stage stopped itself on the STOP file
                return _report_stop(args, control, stages[n:], run_dir, stage)
            if failed is not None and control.cancelled:
                print(f"{lead} cancelled after {took} -> {html}")
                return _report_stop(args, control, stages[n:], run_dir, stage)
            if failed is not None:
                print(f"{lead} FAILED after {took} -> {html}")
                if args.debug:
                    print(failed, file=sys.stderr)
                log = nb_dir / (stage + ".stderr.log")
                more = f"; kernel stderr: {_shown_path(log)}" if _log_has_news(log) else ""
                why = kernel_death(stage, failed) or _cell_error(failed)
                raise StageFailed(f"{stage} failed: {why}; executed notebook: "
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
            _record_stage_time(run_dir, stage, took)
            if stage == "01_generate":
                for line in rejected_prompt_report(run_dir):
                    print(line)
    finally:
        control.restore()
        os.environ.pop(CLI_RUN_ENV, None)
        os.environ.pop(LAUNCH_ENV, None)
        hold.close()
        if control.reason is not None:
            control.stop_file.unlink(missing_ok=True)
    if "03_audit" in stages:
        report = render_report(run_dir)
        print(f"report: {_shown_path(report)}")
    print(f"outputs: {_shown_path(run_dir)}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
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
        import pandas as pd  # heavy: only for the ledger table `status` prints

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
    from eagle3data.prompts.load import prompts_cli  # the prompt readers only for this command

    return prompts_cli(args.path, args.format, split=args.split, subset=args.subset, show=args.show, out=args.out)


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from eagle3data.core.models import prepare_embedded  # the model converter only for this command

    print(prepare_embedded(args.name, force=args.force))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Stage 01 without papermill (what notebook 01 runs): preflight, generate, the ledger table."""
    from eagle3data.generate.run import run_generate  # the stage's stack (tokenizers, HTTP clients) only for this command

    params = load_params(args.params, dict(args.p or []))
    if args.print_engine_command:
        return print_engine_command(params, "01_generate")
    problems = ready_problems(params, ["01_generate"])
    if problems:
        raise UserError("; ".join(problems))
    s = run_generate(params, progress=not args.quiet)
    print(s.table().to_string())
    print(f"{s.status}: {s.new_records} new records in {s.seconds:.1f} s"
          + (f" ({s.stop_reason})" if s.stop_reason else ""))
    return 0 if s.status == "finished" else 3


def cmd_extract(args: argparse.Namespace) -> int:
    """Stage 04 without papermill, on one worker or each of `torchrun`'s: capture, then the last worker merges.

    `--merge-only` merges the index from the finished shards and validates the store. Exit status 0,
    1 when the store fails validation; every rank prints its own line, the progress line is rank 0's.
    """
    params = load_params(args.params, dict(args.p or []))
    if args.print_engine_command:
        return print_engine_command(params, "04_extract_hidden")
    problems = ready_problems(params, ["04_extract_hidden"])
    if problems:
        raise UserError("; ".join(problems))
    with hold_run(params.run_dir, "04_extract_hidden"):  # the ranks of one torchrun hold it together
        return _extract(args, params)


def _extract(args: argparse.Namespace, params: Any) -> int:
    # the stage (torch, the model) only for this command
    from eagle3data.hidden.extract import dist_env, merge_index, run_extract
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.store.reader import HiddenReader
    from eagle3data.hidden.store.validation import validate_store

    if args.merge_only:
        df = merge_index(params)
        v = validate_store(params)
        ver = HiddenReader(hidden_dir(params)).info.get("verification")  # kept when the store is the one verified
        said = ("kept (" + ("passed" if ver["ok"] else "FAILED") + ")") if ver else "none (run verify-hidden)"
        print(f"index: {len(df)} samples, {int(df['length'].sum())} tokens; validation problems: {len(v.problems)}; "
              f"verification: {said}")
        return 0 if v.ok else 1
    res = run_extract(params, progress=dist_env()[0] == 0)
    print(orjson.dumps({"rank": res.rank, **res.stats}).decode())
    if res.merged:
        print(f"index merged: {len(res.index)} samples; validation problems: "
              f"{'skipped' if res.validation is None else len(res.validation.problems)}")
        return 0 if res.validation is None or res.validation.ok else 1
    if res.stats.get("failed"):  # vLLM backend: samples whose reply or file was wrong (resume sends them again)
        for f in res.stats["failures"]:
            print(f"failed {f['key']}: {f['error']}")
        print(f"{res.stats['failed']} samples failed (hidden/vllm_ledger.json); run again to retry them")
        return 1
    print(f"rank {res.rank}: done; {res.waiting_for} samples of other workers not stored yet "
          "(the last worker to finish merges the index)")
    return 0


def print_engine_command(params: Any, stage: str) -> int:
    """Print the vLLM server command a stage launches (`launch: true`), to start it by hand elsewhere."""
    from eagle3data.generate.backends.vllm_server import server_command  # the launcher only for this flag

    if stage == "01_generate":
        if params.generate.backend == "sglang":
            from eagle3data.generate.backends.sglang_server import sglang_command

            print(sglang_command(params, params.generate.sglang, stage="generate").shell())
            return 0
        if params.generate.backend != "vllm":
            raise UserError("--print-engine-command: generate.backend is not vllm or sglang")
        print(server_command(params, params.generate.vllm, stage="generate").shell())
        return 0
    from eagle3data.hidden.capture import layer_plan, load_config
    from eagle3data.hidden.engines.vllm_capture import hidden_command

    if params.hidden.backend not in ("vllm", "sglang"):
        raise UserError("--print-engine-command: hidden.backend is not vllm or sglang")
    try:
        layers = layer_plan(params, load_config(params))
    except (OSError, ValueError):  # the model folder is on the server's machine only: the profile's layer count
        layers = get_profile(params.profile).aux_layers()
        print(f"# model config not readable here: layers from profile {params.profile!r}", file=sys.stderr)
    if params.hidden.backend == "sglang":  # two passes: the aux server, then the final one
        from eagle3data.hidden.engines.sglang_capture import aux_command, final_command

        try:
            config = load_config(params)
        except (OSError, ValueError):
            config = None  # the model folder is on the server's machine only: no architecture rule known here
        print("# pass 1 (aux states):\n" + aux_command(params, layers, config).shell())
        print("# pass 2 (final state, after the norm):\n" + final_command(params).shell())
        return 0
    print(hidden_command(params, layers).shell())
    return 0


def cmd_verify_hidden(args: argparse.Namespace) -> int:
    from eagle3data.hidden.verify.command import verify_cli  # torch and the head only for this command

    # it writes hidden/verify.jsonl and the index's record; a path that is no folder is one line, and is not made
    with hold_run(Path(args.run), "04_verify_hidden", create=False):
        return verify_cli(args.run, recompute=args.recompute, positions=args.positions, out=args.out)


def cmd_audit(args: argparse.Namespace) -> int:
    from eagle3data.audit.command import audit_cli  # the stage (pandas, pyarrow) only for this command

    return audit_cli(args.records, profile=args.profile, out=args.out, tokenizer=args.tokenizer,
                     allow_failed=args.allow_failed)


def cmd_export(args: argparse.Namespace) -> int:
    from eagle3data.export.run import export_cli  # the stage only for this command

    with hold_run(Path(args.run), "05_export", create=False):  # no export of a store that a live 04 is still writing
        return export_cli(args.run, fmt=args.format, out=args.out)


def cmd_value(args: argparse.Namespace) -> int:
    from eagle3data.value.run import value_cli  # the stage only for this command

    with hold_run(Path(args.run), "06_value", create=False):
        return value_cli(args.run, variants=args.variants, overrides=dict(args.p or []))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eagle3data", description=__doc__.split("\n")[0])
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run the stage notebooks headlessly (papermill) for a params file")
    r.add_argument("params", help="params YAML, e.g. params/embedded.yaml")
    r.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"),
                   help="override a param by dotted key, e.g. -p generate.sampling.max_new_tokens 64")
    r.add_argument("--only", action="append", metavar="STAGE",
                   help="run only this stage (01/generate, 02, 03, 04, 05/export, 06/value); repeatable")
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
    g.add_argument("--print-engine-command", action="store_true",
                   help="print the vLLM server command generate.vllm.launch starts, and exit")
    g.set_defaults(func=cmd_generate)

    x = sub.add_parser("extract", help="stage 04 headless, without papermill; one worker of `torchrun -m eagle3data "
                                        "extract` each (the last to finish merges the index)")
    x.add_argument("params", help="params YAML")
    x.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override a param")
    x.add_argument("--merge-only", action="store_true", help="only merge the index and validate the store")
    x.add_argument("--print-engine-command", action="store_true",
                   help="print the vLLM server command hidden.vllm.launch starts (layer ids, connector), and exit")
    x.set_defaults(func=cmd_extract)

    v = sub.add_parser("verify-hidden", help="prove 04's stored states are the target's own (exit 0 pass, 1 fail); "
                                             "writes hidden/verify.jsonl and verify_summary.json")
    v.add_argument("run", help="run folder, e.g. outputs/embedded")
    v.add_argument("--recompute", metavar="N|all", help="samples per shard run through the target again and compared "
                                                        "element-wise (default 2; 0 none; all)")
    v.add_argument("--positions", type=int, metavar="K", help="the most output and prompt positions per sample given "
                                                               "to the target's head (default 64; below it floors "
                                                               "and a per-byte budget choose; 0 every position; else at "
                                                               "least 64)")
    v.add_argument("--out", help="write the per-sample lines here instead of hidden/verify.jsonl")
    v.set_defaults(func=cmd_verify_hidden)

    a = sub.add_parser("audit", help="audit a journal (JSONL) or columnar file; writes verdicts.jsonl, summary.json")
    a.add_argument("records", help="records JSONL (or .parquet)")
    a.add_argument("--profile", help="smollm2, qwen3, kimi-k2.5 (default: the profile the records name)")
    a.add_argument("--out", required=True, help="output folder")
    a.add_argument("--tokenizer", help="tokenizer folder (default: the run's own, from its recorded params)")
    a.add_argument("--allow-failed", action="store_true", help="exit 0 even when records fail a check")
    a.set_defaults(func=cmd_audit)

    e = sub.add_parser("export", help="export a run for a drafter trainer")
    e.add_argument("run", help="run folder, e.g. outputs/embedded")
    e.add_argument("--format", required=True, action="append",
                   choices=["specforge", "speculators", "speculators_online", "specforge_online"],
                   help="the hand-off (repeatable): offline (with 04's states) or *_online (ids and masks only)")
    e.add_argument("--out", help="the format's folder (default <run>/export/<format>); with several --format, the "
                                 "folder holding one per format (default <run>/export)")
    e.set_defaults(func=cmd_export)

    v = sub.add_parser("value", help="stage 06: train a draft on the run's hand-off and measure its acceptance "
                                     "length (exit 3 when stopped; run again to resume)")
    v.add_argument("run", help="run folder with 04's store and 05's speculators hand-off, e.g. outputs/value")
    v.add_argument("--variants", nargs="+", help="variants to train and compare (default: the run's value.variants)")
    v.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"),
                   help="override a value.* param of the run's (e.g. -p value.eval.temperatures '[0.0, 1.0]')")
    v.set_defaults(func=cmd_value)

    pr = sub.add_parser("prompts", help="show what a prompt dataset turns into (counts, rejected rows, examples)")
    pr.add_argument("path", help="file (.jsonl/.json/.parquet/.arrow), folder of shards, builtin:NAME or hf:NAME")
    pr.add_argument("--format", required=True, help="row format, e.g. sharegpt, ultrachat, glaive (docs/01_generate.md: Prompt datasets)")
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
