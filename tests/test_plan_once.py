"""Each stage plans once (issue 22, item 2): 04 builds ONE plan (the mix built with the model's
context limit, the layer plan, the estimate) that its notebook shows and its extraction executes.

Before, notebook 04 built the mix without the context limit, `estimate()` rebuilt it with the limit
and overwrote `hidden/mix.parquet`, and `run_extract(P, mix=mix)` extracted the first mix: with a
small `model.max_context` the too-long samples were fed to the model, and 05 failed on "the
hidden-state index (N samples) differs from the mix (M)".
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BYTES_PER_TOKEN = 5 * 576 + 5 * 4 + 4 + 1  # ci: SmolLM2, final_state both, int8/channel_rms (the default) + ids, mask


def _lengths(run_dir: Path) -> dict[str, int]:
    """Each record's prompt + output length, by key (`dataset/sample_id`)."""
    out = {}
    for f in sorted((run_dir / "records").glob("*.jsonl")):
        for line in f.open():
            r = json.loads(line)
            out[f"{r['dataset']}/{r['sample_id']}"] = len(r["prompt_ids"]) + len(r["output_ids"])
    return out


def _limit(lengths: dict[str, int]) -> int:
    """A context limit that keeps the two shortest records and drops at least one longer one."""
    ls = sorted(lengths.values())
    assert len(ls) >= 3 and ls[1] < ls[-1], ls
    return ls[1]


def _copy_run(ci_run, root: Path) -> Path:
    """A private copy of the ci run (01 done) under `root/ci`."""
    shutil.copytree(ci_run.run_dir / "records", root / "ci" / "records")
    if (ci_run.run_dir / "ledger.json").exists():
        shutil.copy2(ci_run.run_dir / "ledger.json", root / "ci" / "ledger.json")
    return root / "ci"


@pytest.fixture(scope="module")
def run_04_05(ci_run, tmp_path_factory):
    """`python -m eagle3data run params/ci.yaml -p model.max_context <small> --only 04 --only 05`."""
    root = tmp_path_factory.mktemp("plan_once")
    run_dir = _copy_run(ci_run, root)
    lengths = _lengths(run_dir)
    limit = _limit(lengths)
    cmd = [sys.executable, "-m", "eagle3data", "run", "params/ci.yaml", "-p", "output_root", str(root),
           "-p", "model.max_context", str(limit), "--only", "04", "--only", "05", "--progress-every", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    return run_dir, lengths, limit, proc


def _figures(nb_path: Path) -> dict:
    """The `figures` cell's value of an executed notebook."""
    import nbformat

    nb = nbformat.read(nb_path, as_version=4)
    cell = [c for c in nb.cells if c.cell_type == "code" and c.source.strip().endswith("figures")][-1]
    out = next(o for o in cell.outputs if o.output_type == "execute_result")
    return ast.literal_eval(out["data"]["text/plain"])


def test_notebook_04_drops_too_long_samples_before_the_model_and_05_succeeds(run_04_05):
    from eagle3data.hidden.store.index import scan_shards
    from eagle3data.hidden.store.reader import HiddenReader
    from eagle3data.hidden.mix import read_mix

    run_dir, lengths, limit, proc = run_04_05
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hdir = run_dir / "hidden"
    mix = read_mix(hdir)
    long = {k for k, n in lengths.items() if n > limit}
    assert long and len(long) < len(lengths)
    # dropped as too_long by the one mix, with the limit the notebook planned with
    assert {d["key"] for d in mix.dropped if d["reason"] == "too_long"} == long
    assert mix.manifest["settings"]["max_context"] == limit
    keys = [str(s.key) for s in mix.samples]
    assert set(keys) == set(lengths) - long
    # never fed to the model: no shard holds a too-long sample; the index holds exactly the mix, in mix order
    stored = [f"{e['dataset']}/{e['sample_id']}" for es in scan_shards(hdir).shards.values() for e in es]
    assert sorted(stored) == sorted(keys)
    assert HiddenReader(hdir).keys() == keys
    # what the notebook showed is what ran: extracted, estimated and too-long counts are the mix's
    fig = _figures(run_dir / "notebooks" / "04_extract_hidden.ipynb")
    tokens = sum(lengths[k] for k in keys)
    assert fig["samples"] == len(keys) and fig["tokens"] == tokens and fig["too_long"] == len(long)
    assert fig["estimated_bytes"] == tokens * BYTES_PER_TOKEN
    assert fig["validation_problems"] == 0 and fig["merged"] is True
    # 05 exported exactly that mix
    man = json.loads((run_dir / "export" / "specforge" / "manifest.json").read_text())
    assert man["exported"] == len(keys)


@pytest.fixture
def limited(ci_run, tmp_path, monkeypatch):
    """Params of a private ci run copy with a small context limit; `calls` records the stage's steps."""
    from eagle3data.hidden import extract as H
    from eagle3data.hidden import mix as M
    from eagle3data.core.params import load_params

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run_dir = _copy_run(ci_run, tmp_path)
    limit = _limit(_lengths(run_dir))
    calls: list[str] = []

    def traced(mod, name):
        real = getattr(mod, name)

        def wrapper(*a, **kw):
            calls.append(name)
            return real(*a, **kw)

        monkeypatch.setattr(mod, name, wrapper)

    for mod, name in [(H, "build_mix"), (M, "write_mix"), (H, "load_extract_model"), (H, "load_config"),
                      (H, "probe"), (H, "merge_index"), (H, "validate_store"), (H, "read_mix")]:
        traced(mod, name)

    def make(root: Path = tmp_path):
        return load_params(REPO / "params" / "ci.yaml", {"output_root": str(root), "model.max_context": limit,
                                                         "hidden.probe_batches": 1})

    return make, calls, limit


def test_the_plan_is_what_runs_and_the_mix_is_written_once(limited):
    from eagle3data.hidden.extract import plan_extract, run_extract
    from eagle3data.hidden.store.format import HiddenError
    from eagle3data.hidden.mix import hidden_dir

    make, calls, limit = limited
    p = make()
    plan = plan_extract(p)
    path = hidden_dir(p) / "mix.parquet"
    before = path.stat()
    assert calls.count("write_mix") == 1 and calls.count("load_extract_model") == 1
    assert plan.max_context == limit and plan.mix.manifest["settings"]["max_context"] == limit
    assert plan.estimate.tokens_per_s  # timed by the plan, with the model it holds
    plan.estimate.table(), plan.mix.table(), plan.layers_line()  # what the notebook shows in between
    res = run_extract(p, plan=plan, progress=False)
    after = path.stat()
    # written once: not rebuilt, not rewritten, not re-read by the extraction
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert calls.count("build_mix") == 1 and calls.count("write_mix") == 1 and "read_mix" not in calls
    assert calls.count("load_extract_model") == 1 and calls.count("probe") == 1
    # one object: the estimate's samples are the mix's and the extraction's
    keys = [str(s.key) for s in plan.mix.samples]
    assert res.plan is plan and res.estimate is plan.estimate
    assert plan.estimate.samples == len(keys) == res.stats["to_extract"] == res.stats["extracted"] == len(res.index)
    assert plan.estimate.tokens == sum(len(s.input_ids) for s in plan.mix.samples) == int(res.index["length"].sum())
    assert list(res.index["key"]) == keys and res.validation.ok
    assert all(len(s.input_ids) <= limit for s in plan.mix.samples)
    assert {d["key"] for d in res.too_long} == {d["key"] for d in plan.mix.dropped if d["reason"] == "too_long"}
    assert res.too_long and not set(keys) & {d["key"] for d in res.too_long}
    # a plan runs once; a plan of other params is refused
    with pytest.raises(HiddenError, match="has run already"):
        run_extract(p, plan=plan, progress=False)
    with pytest.raises(HiddenError, match="other params"):
        run_extract(make(p.run_dir.parent / "elsewhere"), plan=plan_extract(p, load_model=False), progress=False)


def test_the_notebook_calls_what_the_headless_stage_calls(limited, tmp_path):
    """Notebook 04's cells, run in this process, take the same steps as `run_extract(params)` (the
    `python -m eagle3data extract` path): one mix built and written, one model load, one probe, one merge."""
    import jupytext

    from eagle3data.hidden.extract import run_extract

    make, calls, _ = limited
    run_extract(make(), progress=False)
    headless = list(calls)
    calls.clear()

    shutil.copytree(tmp_path / "ci" / "records", tmp_path / "nb" / "ci" / "records")
    p = make(tmp_path / "nb")
    nb = jupytext.read(REPO / "notebooks" / "04_extract_hidden.py")
    ns: dict = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "parameters" in cell.metadata.get("tags", []):
            ns.update(params_file=str(REPO / "params" / "ci.yaml"),
                      overrides={"output_root": str(tmp_path / "nb"), "model.max_context": p.model.max_context,
                                 "hidden.probe_batches": 1})
            continue
        exec(compile(cell.source, "04_extract_hidden.py", "exec"), ns)
    assert calls == headless, (calls, headless)
    assert calls.count("build_mix") == 1 and calls.count("write_mix") == 1
    assert ns["res"].plan is ns["plan"] and ns["figures"]["samples"] == len(ns["plan"].mix.samples)
