"""04 resumes by a stored sample's ids, not by its key alone.

A sample counts as stored only when a stored copy holds the mix's ids for its key (the ids digest each file's own
index entry records; a file written before digests: the same token count). After 01 re-ran one record in place (other
ids, same key, same length), 04 extracts that sample again, says so in one line, indexes the new copy (the stale one,
still in its old shard, is never indexed, whichever file sorts first), and resumes every other sample untouched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
import torch

from eagle3data.core.params import load_params
from eagle3data.core.reader import Sample, SampleKey
from eagle3data.hidden.capture import Capture, layer_plan
from eagle3data.hidden.extract import run_extract
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store.checksum import ids_digest
from eagle3data.hidden.store.format import INFO_FILE, _torch_dtype
from eagle3data.hidden.store.index import ShardScan, index_rows, match_stored
from eagle3data.hidden.store.reader import HiddenReader

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(ci_run):
    from eagle3data.core.models import model_for

    return model_for(ci_run)


def change_one_output_id(run_dir: Path, key: SampleKey) -> list[int]:
    """01 re-ran `key` in place: one output id in the middle differs, the length is the same; the new input ids."""
    path = run_dir / "records" / f"{key.dataset}.jsonl"
    rows = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    (rec,) = [r for r in rows if SampleKey.of(r) == key]
    k = len(rec["output_ids"]) // 2
    rec["output_ids"][k] = rec["output_ids"][k] + 1 if rec["output_ids"][k] < 1000 else rec["output_ids"][k] - 1
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return rec["prompt_ids"] + rec["output_ids"]


@pytest.mark.parametrize("layout", ["shards", "speculators"])
def test_a_sample_whose_ids_changed_is_extracted_again_and_the_others_resume(ci_run, model, tmp_path, monkeypatch,
                                                                             capsys, layout):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "hidden.probe_batches": 0,
                                                   "hidden.storage": "bf16", "hidden.layout": layout,
                                                   "hidden.verify_after": False})
    hdir = hidden_dir(p)
    first = run_extract(p, progress=False, model=model)
    assert first.merged and first.validation.ok
    keys = [str(s.key) for s in first.plan.mix.samples]
    files = {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in hdir.glob("s*/*.safetensors")}
    old = HiddenReader(hdir)
    before = {k: old.sample(k) for k in keys}
    rows_before = {k: r for k, r in zip(keys, old.index.to_dict("records"))}
    target = first.plan.mix.samples[-1].key
    new_ids = change_one_output_id(p.run_dir, target)
    capsys.readouterr()

    again = run_extract(p, progress=True, model=model)
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("04: ")]
    assert said == [f"04: 1 stored sample held other ids than the mix (01 or 02 ran again since): extracted again, "
                    f"the stale copy left out of the index (e.g. {target})"]
    st = again.stats
    assert st["stale_reextracted"] == 1 and st["to_extract"] == 1 and st["extracted"] == 1
    assert st["already_stored"] == len(keys) - 1
    assert again.merged and again.validation.ok, again.validation.table()  # ids equal to the records: the new copy
    rd = HiddenReader(hdir)
    assert rd.keys() == keys
    got = rd.sample(str(target))
    assert got["input_ids"].tolist() == new_ids
    # the new ids' states: the target's forward on them (it was extracted alone), not the stale copy's
    with Capture(model, layer_plan(p, model.config), _torch_dtype("bfloat16"), p.hidden.final_state) as cap:
        ref = cap.run(torch.tensor([new_ids])).cpu()[0]
    torch.testing.assert_close(got["hidden_states"].float(), ref.float(), rtol=2**-7, atol=1e-2)
    stale = before[str(target)]
    assert len(stale["input_ids"]) == len(new_ids)  # the same token count: a length check alone would resume it
    changed = next(i for i, (x, y) in enumerate(zip(new_ids, stale["input_ids"].tolist())) if x != y)
    assert (got["hidden_states"][changed] != stale["hidden_states"][changed]).any()
    # every other sample resumed untouched: the same file and place, the same bytes
    for key in keys:
        if key == str(target):
            continue
        row = rd.index[rd.index["key"] == key].iloc[0]
        assert (row["shard"], row["offset"]) == (rows_before[key]["shard"], rows_before[key]["offset"])
        assert torch.equal(rd.sample(key)["hidden_states"], before[key]["hidden_states"])
    for f, (mtime, data) in files.items():
        if layout == "shards" or str(target) not in [e["key"] for e in orjson.loads(_meta(f))["samples"]]:
            assert f.stat().st_mtime_ns == mtime and f.read_bytes() == data, f"{f.name} was written again"
    if layout == "shards":  # the stale copy is still in its old shard, counted, never indexed
        assert orjson.loads((hdir / INFO_FILE).read_bytes())["stale_not_indexed"] == 1

    # a third run: every stored sample is the mix's, nothing to do, nothing said
    third = run_extract(p, progress=True, model=model)
    assert third.stats["to_extract"] == 0 and "stale_reextracted" not in third.stats
    assert not [x for x in capsys.readouterr().out.splitlines() if x.startswith("04: ")]


def _meta(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()["eagle3data"]


def _sample(sid: str, ids: list[int]) -> Sample:
    return Sample("d", sid, "local", True, None, ids, [0] * (len(ids) - 1) + [1])


def _entry(s: Sample, digest: str | None, length: int | None = None) -> dict:
    e = {"dataset": s.dataset, "sample_id": s.sample_id, "turn": None, "offset": 0,
         "length": len(s.input_ids) if length is None else length, "loss_tokens": 1, "position": 0}
    return e if digest is None else {**e, "ids_digest": digest}


def test_the_copy_with_the_mix_ids_wins_and_a_store_without_digests_is_compared_by_token_count():
    a, b, c, d = (_sample("1", [5, 6, 7]), _sample("2", [5, 6, 7, 8]), _sample("3", [9, 9]), _sample("4", [1, 2]))
    scan = ShardScan(shards={
        # written before digests: a's copy has its token count (resumed, said), b's another (extracted again)
        "shards/r000-00000.safetensors": [_entry(a, None), _entry(b, None, length=3),
                                          _entry(c, ids_digest([9, 8]))],  # c's stale copy sorts first
        "shards/r000-00001.safetensors": [_entry(c, ids_digest(c.input_ids)), _entry(d, ids_digest([2, 1]))],
        "shards/r001-00000.safetensors": [_entry(c, ids_digest(c.input_ids))],  # c again (world size changed)
    })
    m = match_stored(scan, [a, b, c, d])
    assert set(m.chosen) == {a.key, c.key} and m.stale == [b.key, d.key]
    assert m.chosen[c.key][0] == "shards/r000-00001.safetensors"  # its ids, first by name: the stale copy never
    assert (m.by_length, m.duplicates, m.stale_copies) == (1, 1, 3)
    assert m.line() == ("04: 2 stored samples held other ids than the mix (01 or 02 ran again since): extracted again, "
                        "the stale copies left out of the index (e.g. d/2); 1 stored sample without an ids digest "
                        "(written before digests) resumed by token count only")
    rows, missing, duplicates, stale = index_rows(scan, [a, b, c, d])
    assert [(r["key"], r["shard"]) for r in rows] == [("d/1", "shards/r000-00000.safetensors"),
                                                      ("d/3", "shards/r000-00001.safetensors")]
    assert missing == ["d/2", "d/4"] and duplicates == 1 and stale == 3
    assert match_stored(scan, [c]).line() is None
