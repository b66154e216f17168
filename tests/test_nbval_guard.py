"""The nbval suite guards the audit table: a changed count in a fixture record must fail it.

Runs the golden 03_audit notebook under nbval twice on a private copy of the fixture run:
unchanged (it must pass, so the harness itself is sound), then with one record's end-of-turn
removed (it must fail, on the check table).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _prepare(tmp: Path, mutate: bool) -> Path:
    from eagle3data.generate.run import run_generate
    from eagle3data.core.params import load_params
    from eagle3data.rebuild.run import run_reconstruct

    cfg = yaml.safe_load((REPO / "tests/fixtures/nbval.yaml").read_text())
    cfg["output_root"] = str(tmp / "outputs" / ".nbval")
    params_file = tmp / "nbval.yaml"
    params_file.write_text(yaml.safe_dump(cfg))
    params = load_params(params_file)
    shutil.copytree(REPO / "tests/fixtures/runs/nbval", params.run_dir)
    if mutate:  # drop the end-of-turn of the first completed b1_glaive record
        path = params.run_dir / "records" / "b1_glaive.jsonl"
        recs = [json.loads(line) for line in path.open()]
        rec = next(r for r in recs if r["finish_reason"] == "stop")
        assert rec["output_ids"][-1] == 2
        rec["output_ids"] = rec["output_ids"][:-1]
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    run_generate(params, progress=False)  # resumes: nothing to generate; the ledger as the golden saw it
    run_reconstruct(params, progress=False)
    nb = nbformat.read(REPO / "tests/golden/03_audit.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", []))
    cell.source = f'params_file = "{params_file}"\noverrides = {{}}\n'
    out = tmp / "03_audit.ipynb"
    nbformat.write(nb, out)
    return out


def _nbval(nb: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--nbval",
         "--nbval-current-env", "--nbval-sanitize-with", str(REPO / "tests/nbval_sanitize.cfg"),
         "--rootdir", str(nb.parent), str(nb)],
        cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("mutate", [False, True], ids=["unchanged-passes", "changed-count-fails"])
def test_golden_audit_notebook_catches_a_changed_count(tmp_path, mutate):
    proc = _nbval(_prepare(tmp_path, mutate))
    if not mutate:
        assert proc.returncode == 0, proc.stdout[-4000:]
    else:
        assert proc.returncode != 0
        assert "check-table" in proc.stdout and "output.ends_with_eot" in proc.stdout, proc.stdout[-4000:]


def _refresh_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("golden_refresh_t", REPO / "tests" / "golden" / "refresh.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_session_runs_the_golden_notebooks_on_its_own_copy():
    """Two pytest sessions in one checkout: each golden notebook's parameters name this session's folder."""
    import os
    from types import SimpleNamespace

    import conftest
    from eagle3data.core.params import load_params

    assert conftest.NBVAL_ROOT == f"outputs/.nbval/session-{os.getpid()}"
    for name in ("03_audit", "03_audit_kimi", "05_export"):
        nb = nbformat.read(REPO / "tests/golden" / f"{name}.ipynb", as_version=4)
        cell = next(c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", []))
        conftest.pytest_collection_modifyitems(None, None, [SimpleNamespace(cell=cell, nodeid=name)])
        ns: dict = {}
        exec(cell.source, ns)
        run_dir = load_params(ns["params_file"], ns["overrides"]).run_dir
        assert run_dir.parent == REPO / conftest.NBVAL_ROOT, (name, run_dir)
        assert run_dir.is_dir(), f"{run_dir}: the session start copies the fixture run there"
    bare = nbformat.v4.new_code_cell('params_file = "x.yaml"\n', metadata={"tags": ["injected-parameters"]})
    with pytest.raises(pytest.UsageError, match="overrides"):
        conftest.pytest_collection_modifyitems(None, None, [SimpleNamespace(cell=bare, nodeid="x")])


def test_a_finished_sessions_folder_is_dropped_and_a_running_ones_kept(tmp_path, monkeypatch):
    import os

    mod = _refresh_module()
    monkeypatch.setattr(mod, "SESSIONS", tmp_path)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    finished, running = tmp_path / f"session-{done.stdout.strip()}", tmp_path / f"session-{os.getpid()}"
    for p in (finished, running):
        (p / "nbval").mkdir(parents=True)
    assert mod.drop_finished_sessions() == [finished]
    assert running.is_dir() and not finished.exists()
