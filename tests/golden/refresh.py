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
from pathlib import Path

import papermill as pm

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "runs" / "nbval"
PARAMS = "tests/fixtures/nbval.yaml"
GOLDEN = REPO / "tests" / "golden"
STAGES = ["01_generate", "02_reconstruct", "03_audit", "04_extract_hidden", "05_export"]


def reset_fixture_run() -> Path:
    """A fresh copy of the fixture run at outputs/.nbval/nbval (what the notebooks read)."""
    from eagle3data.params import load_params

    run_dir = load_params(REPO / PARAMS).run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    shutil.copytree(FIXTURE, run_dir)
    return run_dir


def main(stages: list[str]) -> None:
    reset_fixture_run()
    for stage in STAGES:
        if stages and stage not in stages:
            continue
        print(f"golden {stage}")
        pm.execute_notebook(str(REPO / "notebooks" / f"{stage}.ipynb"), str(GOLDEN / f"{stage}.ipynb"),
                            parameters={"params_file": PARAMS, "overrides": {}}, kernel_name="python3",
                            cwd=str(REPO), progress_bar=False)


if __name__ == "__main__":
    main(sys.argv[1:])
