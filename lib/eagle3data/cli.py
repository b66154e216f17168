"""Command line: `python -m eagle3data run|audit|export|prepare-model`.

`run` executes the stage notebooks headlessly with papermill into `outputs/<run>/notebooks/`
(each also saved as HTML), then renders `outputs/<run>/report.html`. It is what `make run`
calls; a notebook opened in JupyterLab runs the same code.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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
def _kernel_stderr_filtered() -> Iterator[None]:
    """Hold back the kernel's start-up warning; pass every other stderr line through."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not any(n in line for n in KERNEL_NOISE):
                    sys.stderr.write(line)


def execute_notebook(stage: str, params_file: Path, overrides: dict[str, str], out_dir: Path) -> Path:
    """Run one stage notebook through papermill; save the executed copy and its HTML."""
    import papermill as pm

    from .params import repo_root
    from .report import notebook_to_html

    src = repo_root() / "notebooks" / f"{stage}.ipynb"
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{stage}.ipynb"
    try:
        with _kernel_stderr_filtered():
            pm.execute_notebook(
                str(src), str(dst),
                parameters={"params_file": str(params_file), "overrides": overrides},
                kernel_name="python3", cwd=str(repo_root()), progress_bar=False, log_output=False,
            )
    finally:
        if dst.exists():
            notebook_to_html(dst, dst.with_suffix(".html"))
    return dst


def cmd_run(args: argparse.Namespace) -> int:
    from .params import ParamsError, load_params

    overrides = dict(args.p or [])
    params_file = Path(args.params).resolve()
    try:
        params = load_params(params_file, overrides)
    except ParamsError as e:
        print(e, file=sys.stderr)
        return 2
    stages = [resolve_stage(s) for s in args.only] if args.only else list(STAGES)
    if not params.hidden.enabled and not args.only:
        stages = [s for s in stages if s not in HIDDEN_STAGES]
    run_dir = params.run_dir
    nb_dir = run_dir / "notebooks"
    print(f"run {params.run_name!r} -> {run_dir}")
    for stage in stages:
        t0 = time.perf_counter()
        print(f"  {stage} ...", end="", flush=True)
        try:
            execute_notebook(stage, params_file, overrides, nb_dir)
        except Exception as e:  # papermill raises PapermillExecutionError with the cell's traceback
            print(" FAILED")
            print(f"{stage} failed; executed notebook: {nb_dir / (stage + '.ipynb')}\n{e}", file=sys.stderr)
            return 1
        print(f" done in {time.perf_counter() - t0:.0f} s -> {nb_dir / (stage + '.html')}")
    if "03_audit" in stages:
        from .report import render_report

        report = render_report(run_dir)
        print(f"report: {report}")
    print(f"outputs: {run_dir}")
    return 0


def cmd_prompts(args: argparse.Namespace) -> int:
    from .prompts import prompts_cli

    return prompts_cli(args.path, args.format, split=args.split, subset=args.subset, show=args.show, out=args.out)


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from .models import prepare_embedded

    print(prepare_embedded(args.name, force=args.force))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from .audit import audit_cli

    return audit_cli(args.records, profile=args.profile, out=args.out, tokenizer=args.tokenizer)


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_cli

    return export_cli(args.run, fmt=args.format, out=args.out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eagle3data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run the stage notebooks headlessly (papermill) for a params file")
    r.add_argument("params", help="params YAML, e.g. params/embedded.yaml")
    r.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"),
                   help="override a param by dotted key, e.g. -p generate.sampling.max_new_tokens 64")
    r.add_argument("--only", action="append", metavar="STAGE",
                   help="run only this stage (01/generate, 02, 03, 04, 05/export); repeatable")
    r.set_defaults(func=cmd_run)

    a = sub.add_parser("audit", help="audit a journal (JSONL) or columnar file; writes verdicts.jsonl, summary.json")
    a.add_argument("records", help="records JSONL (or .parquet)")
    a.add_argument("--profile", required=True, help="smollm2, qwen3, kimi-k2.5")
    a.add_argument("--out", required=True, help="output folder")
    a.add_argument("--tokenizer", help="tokenizer folder (enables text checks)")
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
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
