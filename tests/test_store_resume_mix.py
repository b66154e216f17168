"""04 resumed after its mix changed (more records, other caps) in a per-sample layout: a sample now at the position of
one stored earlier gets a file of its own (never written over the other's), the stored samples are kept as they are,
and the store merges and verifies with every key's file holding that key's states."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from eagle3data.core.params import load_params
from eagle3data.hidden.extract import run_extract

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("layout", ["speculators"])
def test_a_changed_mix_resumes_without_writing_over_a_stored_sample(ci_run, tmp_path, monkeypatch, layout):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    ov = {"output_root": str(tmp_path), "hidden.probe_batches": 0, "hidden.layout": layout}
    first = run_extract(load_params(REPO / "params" / "ci.yaml", ov | {"hidden.dataset_caps": {"b1_glaive": 1}}),
                        progress=False)
    samples = tmp_path / "ci" / "hidden" / "samples"
    before = {f.name: f.stat().st_mtime_ns for f in samples.glob("p*")}
    old = [str(s.key) for s in first.plan.mix.samples]
    second = run_extract(load_params(REPO / "params" / "ci.yaml", ov), progress=False)
    new = [str(s.key) for s in second.plan.mix.samples]
    # the fixture's point: some sample moved to a position another one was stored at
    assert any(i < len(old) and new[i] != old[i] and new[i] not in old for i in range(len(new)))
    assert second.merged and second.verification.ok
    assert second.stats["extracted"] == len(set(new) - set(old))
    for name, mtime in before.items():
        assert (samples / name).stat().st_mtime_ns == mtime, f"{name} was written again"
    hdir = tmp_path / "ci" / "hidden"
    assert json.loads((hdir / "index.json").read_text())["missing"] == 0
    import pandas as pd

    rows = pd.read_parquet(hdir / "index.parquet")
    assert list(map(str, rows["key"])) == new  # the index in the new mix's order
    for key, shard in zip(rows["key"], rows["shard"]):  # each row's file holds that row's sample
        with safe_open(str(hdir / shard), "pt") as h:
            meta = json.loads(h.metadata()["eagle3data"])["samples"][0]
        assert f"{meta['dataset']}/{meta['sample_id']}" == str(key)
