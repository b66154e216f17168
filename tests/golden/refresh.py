"""Re-execute the golden notebooks on the fixture run (`make golden`).

The notebooks under tests/golden/ are the stage notebooks executed by papermill on the
committed fixture run (tests/fixtures/runs/nbval, params tests/fixtures/nbval.yaml); nbval
re-runs them in `make test` and compares every cell's output (after the sanitize patterns in
tests/nbval_sanitize.cfg). Refresh them only when a change is meant to alter what a stage
shows (a new column, a new check, a fixed count), then read the diff before committing.
"""

from __future__ import annotations

import shutil
import sys
import os
from pathlib import Path

import papermill as pm

REPO = Path(__file__).resolve().parents[2]
# the kernels read the Kimi fixture with the tests' stand-in vocabulary (tests/synthetic.py)
os.environ["EAGLE3DATA_PLUGINS"] = str(REPO / "tests" / "synthetic.py")
FIXTURES = REPO / "tests" / "fixtures"
GOLDEN = REPO / "tests" / "golden"
# golden notebook -> (stage notebook, params file); executed in this order (each stage reads the last)
GOLDENS = {
    "01_generate": ("01_generate", "tests/fixtures/nbval.yaml"),
    "02_reconstruct": ("02_reconstruct", "tests/fixtures/nbval.yaml"),
    "03_audit": ("03_audit", "tests/fixtures/nbval.yaml"),
    "03_audit_kimi": ("03_audit", "tests/fixtures/kimi_synthetic.yaml"),
    "04_extract_hidden": ("04_extract_hidden", "tests/fixtures/nbval.yaml"),
    "05_export": ("05_export", "tests/fixtures/nbval.yaml"),
}


SESSIONS = REPO / "outputs" / ".nbval"


def reset_fixture_runs(output_root: str | None = None) -> list[Path]:
    """Fresh copies of the committed fixture runs under `output_root` (the params' own, outputs/.nbval/, by default).

    A pytest session passes its own folder (outputs/.nbval/session-<pid>/, tests/conftest.py), so
    concurrent sessions in one checkout do not reset each other's runs.
    """
    from eagle3data.core.params import load_params

    out = []
    for params_file in sorted({p for _, p in GOLDENS.values()}):
        params = load_params(REPO / params_file, {"output_root": output_root} if output_root else None)
        src = FIXTURES / "runs" / params.run_name
        if params.run_dir.exists():
            shutil.rmtree(params.run_dir)
        shutil.copytree(src, params.run_dir)
        out.append(params.run_dir)
    return out


def drop_finished_sessions() -> list[Path]:
    """Remove the session folders (outputs/.nbval/session-<pid>/) of pytest processes that are gone.

    A finished session's folder stays until the next session starts, to look into after a failure.
    """
    import psutil

    gone = [p for p in SESSIONS.glob("session-*")
            if p.name.removeprefix("session-").isdigit() and not psutil.pid_exists(int(p.name.removeprefix("session-")))]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def main(names: list[str]) -> None:
    """Refresh the named goldens (all when none). Each stage reads what the earlier ones left in the fixture run, so
    the goldens before a named one run too, into a scratch copy that is not kept."""
    import tempfile

    unknown = [n for n in names if n not in GOLDENS]
    if unknown:
        raise SystemExit(f"unknown golden {unknown[0]!r}; known: {', '.join(GOLDENS)}")
    order = list(GOLDENS)
    last = max((order.index(n) for n in names), default=len(order) - 1)
    reset_fixture_runs()
    with tempfile.TemporaryDirectory() as scratch:
        for name in order[: last + 1]:
            stage, params_file = GOLDENS[name]
            keep = not names or name in names
            print(f"golden {name}" if keep else f"golden {name} (run for the stages after it; not kept)")
            out = GOLDEN / f"{name}.ipynb" if keep else Path(scratch) / f"{name}.ipynb"
            pm.execute_notebook(str(REPO / "notebooks" / f"{stage}.ipynb"), str(out),
                                parameters={"params_file": params_file, "overrides": {}}, kernel_name="python3",
                                cwd=str(REPO), progress_bar=False)
            if keep:
                stabilize(out)


def stabilize(path: Path) -> None:
    """Drop what changes on every execution and is never compared, so a refresh diff shows only real changes.

    Per cell: papermill's timings and the kernel's execution timestamps; the injected
    parameters cell gets a fixed id instead of a random one. Notebook-level: papermill's run
    record and the widget state (progress bars' model ids). nbval compares outputs only.
    """
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)
    nb.metadata.pop("papermill", None)
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
        if "injected-parameters" in cell.metadata.get("tags", []):
            cell.id = "injected-parameters"
    nbformat.write(nb, path)


if __name__ == "__main__":
    main(sys.argv[1:])
