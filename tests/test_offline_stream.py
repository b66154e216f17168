"""The offline speculators hand-off's dataset and 04's store validation stream (issue 59): a chunk setting, not the run,
sets their memory, and what they give is what the in-memory code gave.

The store is 04's layout made without a model (random bf16 states of hidden size 8 for the mix's samples, written by
04's own shard writer and merged by 04's own merge), on hand-made runs: exact records, records rebuilt by 02, a
retried error, a conversation's turns. (1) The `datasets` folder written a chunk at a time equals the one the
in-memory writer (`Dataset.from_dict` of every row, `save_to_disk`) wrote: rows, dtypes, order, files, state and info,
and speculators' own loader reads the same items from both. (2) Python's allocations while the offline hand-off is
written do not grow with the number of rows (tracemalloc, a small chunk). (3) `validate_store` gives the in-memory
validation's verdicts on a clean store and on stores with each kind of problem, and (4) its memory does not grow with
the number of samples either.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from eagle3data.core.params import load_params
from eagle3data.core.profiles import AuxLayers
from eagle3data.core.reader import SampleKey, read_run
from eagle3data.export.handoff import write_handoff
from eagle3data.export.run import select_samples
from eagle3data.export.vocab import build_draft_vocab
from eagle3data.hidden.merge import merge_store
from eagle3data.hidden.mix import Mix, build_mix, hidden_dir, read_mix, source_sequences
from eagle3data.hidden.store.format import _torch_dtype, shard_dir, state_names
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.store.validation import sample_problems, validate_store
from eagle3data.hidden.store.writer import open_writer
from eagle3data.trainers.speculators import write_dataset
from runfiles import make_record, write_jsonl

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 8
LAYERS = AuxLayers(30, (2, 15, 27), (1, 14, 26))  # SmolLM2's plan (ci.yaml's model)


def _params(root: Path, name: str, chunk: int, **over):
    return load_params(REPO / "params" / "ci.yaml", {
        "output_root": str(root), "run_name": name, "hidden.storage": "bf16", "hidden.probe_batches": 0,
        "hidden.mix_chunk_rows": chunk, "export.chunk_rows": chunk, "export.allow_unverified": True,
        "export.draft_vocab_size": 64, **over})


def _varied_run(run_dir: Path) -> None:
    """Exact and rebuilt records, a retried error, a conversation's three turns, in two datasets."""
    write_jsonl(run_dir / "records" / "b1_glaive.jsonl", [
        make_record("b1_glaive", 1, (1, 2, 3), (10, 11, 2)),
        make_record("b1_glaive", 2, (1, 2, 3), None, finish_reason="error", error="timeout"),  # retried below
        make_record("b1_glaive", 3, (1, 2, 3), (12, 13, 14, 2)),
        make_record("b1_glaive", 2, (1, 2, 3), (15, 16, 2)),
        make_record("b1_glaive", 6, (7,), None, source="api"),  # rebuilt by 02
        *[make_record("b1_glaive", 100 + i, (1, 2, 3 + i), tuple(range(40 + i, 48 + 2 * i)) + (2,)) for i in range(7)],
    ])
    write_jsonl(run_dir / "records" / "b5_openthoughts.jsonl", [
        make_record("b5_openthoughts", "c/1", (1, 9), (50, 51, 2), turn=0),
        make_record("b5_openthoughts", "c/1", (1, 9, 50, 51, 2, 9), (52, 53, 2), turn=1),
        make_record("b5_openthoughts", "c/1", (1, 9, 50, 51, 2, 9, 52, 53, 2, 9), (54, 2), turn=2),
        *[make_record("b5_openthoughts", 200 + i, (4, 5 + i), (70 + i, 71, 2)) for i in range(4)],
    ])
    write_jsonl(run_dir / "reconstruct" / "b1_glaive.jsonl", [
        {"dataset": "b1_glaive", "sample_id": 6, "source": "api", "ids_exact": False, "proof_level": "token",
         "input_ids": [7, 80, 81, 82, 2], "loss_mask": [0, 1, 1, 1, 1]}])


def _big_run(run_dir: Path, n: int) -> None:
    """n records of 2,000 tokens, half exact, half rebuilt by 02."""
    rng = np.random.default_rng(0)
    recs, rebuilt = [], []
    for i in range(n):
        ids = rng.integers(100, 49000, size=2000).tolist()
        if i % 2:
            recs.append(make_record("b1_glaive", i, ids[:200], ids[200:] + [2]))
        else:
            recs.append(make_record("b1_glaive", i, ids[:200], None, source="api"))
            rebuilt.append({"dataset": "b1_glaive", "sample_id": i, "ids_exact": False, "proof_level": "token",
                            "input_ids": ids + [2], "loss_mask": [0] * 200 + [1] * 1801})
    write_jsonl(run_dir / "records" / "b1_glaive.jsonl", recs)
    write_jsonl(run_dir / "reconstruct" / "b1_glaive.jsonl", rebuilt)


def _store(p) -> Mix:
    """04's written mix and its store, without a model: random bf16 states per sample, 04's shard writer and merge."""
    mix = build_mix(p, max_context=8192)
    hp = p.hidden
    states = list(state_names(hp.final_state))
    info = {"model": p.model.name, "profile": p.profile, "hidden_size": HIDDEN, "dtype": hp.dtype,
            "num_layers": LAYERS.num_layers, "hf_indices": list(LAYERS.hf_indices),
            "layer_outputs": list(LAYERS.layer_outputs), "states": states, "final_state": hp.final_state,
            "layout": "shards", "storage": hp.codec().as_dict(), "mix_fingerprint": mix.manifest.get("fingerprint")}
    writer = open_writer(hidden_dir(p), 0, "shards", hp.shard_bytes, info)
    gen, at = torch.Generator().manual_seed(0), 0
    for ss in mix.iter_samples():
        for s in ss:
            writer.add(s, at, torch.randn(len(s.input_ids), len(states), HIDDEN, generator=gen).to(torch.bfloat16))
            at += 1
    writer.flush()
    merge_store(p, LAYERS, HIDDEN, mix=read_mix(hidden_dir(p)))
    return read_mix(hidden_dir(p))


def _vocab():
    return build_draft_vocab(np.ones(49152, dtype=np.int64), 64)


# ---------------------------------------------------------------- the offline speculators dataset


def _in_memory_dataset(samples, out: Path) -> None:
    """The writer this replaced (trainers/speculators.py before issue 59's change): every row in one Dataset."""
    from datasets import Dataset, Features, Sequence as Seq, Value

    feats = Features({"input_ids": Seq(Value("int64")), "loss_mask": Seq(Value("int64")), "seq_len": Value("int64")})
    ds = Dataset.from_dict({"input_ids": [list(map(int, s.input_ids)) for s in samples],
                            "loss_mask": [list(map(int, s.loss_mask)) for s in samples],
                            "seq_len": [len(s.input_ids) for s in samples]}, features=feats)
    for old in out.glob("data-*.arrow"):
        old.unlink()
    ds.with_format("torch").save_to_disk(str(out))


def _dataset(folder: Path) -> dict:
    """What a `datasets` folder gives `load_from_disk`: rows in order, columns, features and Arrow schema, format,
    the tensors' dtypes; and its files, state (without the fingerprint) and info."""
    from datasets import load_from_disk

    ds = load_from_disk(str(folder))
    state = json.loads((folder / "state.json").read_text())
    return {"rows": [(r["input_ids"], r["loss_mask"], r["seq_len"]) for r in ds.with_format(None)],
            "columns": ds.column_names, "features": str(ds.features), "schema": str(ds.data.schema),
            "format": ds.format, "dtypes": [(str(r["input_ids"].dtype), str(r["loss_mask"].dtype), str(r["seq_len"].dtype))
                                            for r in ds],
            "files": sorted(p.name for p in folder.glob("data-*")),
            "state": {k: v for k, v in state.items() if k != "_fingerprint"},
            "info": json.loads((folder / "dataset_info.json").read_text())}


def test_the_dataset_written_in_chunks_equals_the_in_memory_one(tmp_path):
    p = _params(tmp_path, "varied", 4)
    _varied_run(p.run_dir)
    mix = _store(p)
    samples = mix.samples
    assert len(samples) == 18 and len(samples) > p.export.chunk_rows  # chunks of 4, the last one short
    ref = tmp_path / "in_memory"
    _in_memory_dataset(samples, ref)
    want = _dataset(ref)
    assert want["rows"] == [(s.input_ids, s.loss_mask, len(s.input_ids)) for s in samples]  # mix order
    assert want["dtypes"][0] == ("torch.int64",) * 3 and want["format"]["type"] == "torch"

    out = p.run_dir / "export" / "speculators"  # 05's offline hand-off, from its Selection read 4 rows at a time
    out.mkdir(parents=True)
    (out / "data-00001-of-00002.arrow").write_bytes(b"an earlier, larger hand-off's")
    (out / "data-00000.arrow.tmp-host-1").write_bytes(b"a killed run's")
    sel = select_samples(p)
    assert [len(c) for c in sel.chunks()] == [4, 4, 4, 4, 2]
    manifest = write_handoff(p, sel, out, "speculators", vocab=_vocab())
    assert manifest["rows"] == 18 and manifest["plan"]["mode"] == "convert"
    assert _dataset(out) == want
    for chunk_rows in (1, 5, 10_000):  # a list of samples, a chunk of rows at a time
        assert _dataset(_write(samples, tmp_path / f"list{chunk_rows}", chunk_rows)) == want, chunk_rows
    fp = {json.loads((d / "state.json").read_text())["_fingerprint"] for d in (out, tmp_path / "list1")}
    assert len(fp) == 1  # the rows' content, whatever the chunks
    other = [samples[1], samples[0], *samples[2:]]
    assert json.loads((_write(other, tmp_path / "other", 4) / "state.json").read_text())["_fingerprint"] not in fp

    # no row (05 refuses an empty mix before this): one empty file of these columns, which load_from_disk reads
    # (save_to_disk writes no file for 0 rows, and load_from_disk then fails)
    empty = _dataset(_write([], tmp_path / "empty", 4))
    assert empty["rows"] == [] and empty["files"] == ["data-00000-of-00001.arrow"]
    assert {k: empty[k] for k in ("columns", "features", "schema", "format", "info")} == \
        {k: want[k] for k in ("columns", "features", "schema", "format", "info")}

    pytest.importorskip("speculators")
    from speculators.train.data import ArrowDataset

    (ref / "hidden_states").symlink_to(out / "hidden_states")  # the same states beside the in-memory rows
    ours, theirs = (ArrowDataset(max_len=4096, datapath=str(d), on_missing="raise", transfer=None) for d in (out, ref))
    assert len(ours) == len(theirs) == 18 and ours.approx_lengths == theirs.approx_lengths
    for i in range(18):
        a, b = ours[i], theirs[i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a), i
        assert a["input_ids"].tolist() == samples[i].input_ids and a["loss_mask"].tolist() == samples[i].loss_mask


def _write(samples, out: Path, chunk_rows: int) -> Path:
    write_dataset(samples, out, chunk_rows)
    return out


def _handoff_peak(p) -> int:
    out, vocab = p.run_dir / "export" / "speculators", _vocab()
    sel = select_samples(p)
    tracemalloc.start()
    try:
        write_handoff(p, sel, out, "speculators", vocab=vocab)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _runs(root: Path, n: int) -> list:
    """Stored runs of 4, n and 4n samples of 2,001 tokens, at a chunk of 4."""
    runs = []
    for name, rows in (("warm", 4), ("n", n), ("4n", 4 * n)):
        p = _params(root, name, 4)
        _big_run(p.run_dir, rows)
        _store(p)
        runs.append(p)
    return runs


def test_the_offline_handoffs_memory_does_not_rise_with_the_number_of_rows(tmp_path, monkeypatch):
    """Python's peak while 05 writes the offline speculators hand-off (states converted, the dataset): set by
    `export.chunk_rows`, not the run (what grows is a few small facts per row: keys, file names, index rows).
    The in-memory writer, measured the same way, grows by the rows' ids."""
    import eagle3data.trainers.speculators as speculators

    n = 40
    runs = _runs(tmp_path, n)
    _handoff_peak(runs[0])  # imports, datasets' caches
    peaks = _handoff_peak(runs[1]), _handoff_peak(runs[2])
    per_row = (peaks[1] - peaks[0]) / (3 * n)  # 2.6 kB measured (2026-12-07)
    from datasets import load_from_disk

    ds = load_from_disk(str(runs[2].run_dir / "export" / "speculators")).with_format(None)
    assert len(ds) == 4 * n and ds[4 * n - 1]["seq_len"] == 2001
    monkeypatch.setattr(speculators, "write_dataset", lambda rows, out, chunk_rows=256: _in_memory_dataset(rows, out))
    old = _handoff_peak(runs[1]), _handoff_peak(runs[2])
    old_per_row = (old[1] - old[0]) / (3 * n)  # ~200 kB: a row's 2,001 ids and mask as Python lists
    assert per_row < 4000 and old_per_row > 25 * per_row, (peaks, per_row, old, old_per_row)


# ---------------------------------------------------------------- validate_store


def _in_memory_validation(p, mix: Mix | None = None) -> tuple:
    """validate_store before issue 59's change (the whole run through `read_run`, the mix's samples in memory)."""
    hdir = hidden_dir(p)
    reader, mix = HiddenReader(hdir), mix or read_mix(hdir)
    sources = source_sequences(p, mix.view)
    hsize, dtype = reader.info["hidden_size"], _torch_dtype(reader.info["dtype"])
    problems, seen, tokens = [], 0, 0
    for smp in reader:
        seen += 1
        tokens += int(smp["length"])
        for check, detail in sample_problems(smp, sources.get(SampleKey.of(smp)), (len(reader.states), hsize), dtype):
            problems.append({"key": str(SampleKey.of(smp)), "dataset": smp["dataset"], "sample_id": smp["sample_id"],
                             "check": check, "detail": detail})
    keys = [str(s.key) for s in mix.samples]
    if seen != len(keys) or reader.keys() != keys:
        problems.append({"key": "*", "dataset": "*", "sample_id": "*", "check": "coverage",
                         "detail": f"{seen} stored samples, {len(keys)} in the mix: the index must hold "
                                   "exactly the mix's keys in mix order"})
    return seen, tokens, problems, len(keys), len(reader.info.get("too_long", []))


def _verdict(v) -> tuple:
    return v.samples, v.tokens, v.problems, v.mix_samples, v.too_long


def _journal(p, name: str) -> tuple[Path, list[dict]]:
    path = p.run_dir / "records" / f"{name}.jsonl"
    return path, [orjson.loads(x) for x in path.read_bytes().splitlines()]


def _set_nan(p, key: str) -> None:
    """One stored value of `key`'s sample made NaN, in its shard (metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    rd = HiddenReader(hidden_dir(p))
    row = rd.index.iloc[rd.row(key)]
    path = hidden_dir(p) / row["shard"]
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["hidden_states"][int(row["offset"]) + 1, 2, 3] = float("nan")
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_validate_store_gives_the_in_memory_verdicts(tmp_path, chunk):
    p = _params(tmp_path, "varied", chunk, **{"hidden.shard_bytes": 4000})  # several shards
    _varied_run(p.run_dir)
    mix = _store(p)
    assert len(set(HiddenReader(hidden_dir(p)).index["shard"])) > 2
    clean = validate_store(p)
    assert clean.ok and (clean.samples, clean.mix_samples) == (18, 18)
    assert _verdict(clean) == _in_memory_validation(p)
    assert _verdict(validate_store(p, mix=mix)) == _verdict(clean)

    path, recs = _journal(p, "b1_glaive")  # a record's ids changed, one deleted, one now an error
    recs[0]["output_ids"][0] += 1
    recs = [r for r in recs if r["sample_id"] != 3]
    recs[-1]["finish_reason"] = "error"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    rb = p.run_dir / "reconstruct" / "b1_glaive.jsonl"  # 02's rebuilt mask of b1_glaive/6 changed
    line = orjson.loads(rb.read_bytes())
    line["loss_mask"][1] = 0
    rb.write_bytes(orjson.dumps(line) + b"\n")
    turn = p.run_dir / "records" / "b5_openthoughts.jsonl"  # a turn's record gone from the run
    turn.write_bytes(b"".join(x + b"\n" for x in turn.read_bytes().splitlines() if b'"turn":1' not in x))
    _set_nan(p, "b5_openthoughts/201")
    bad = validate_store(p)
    assert _verdict(bad) == _in_memory_validation(p)
    assert sorted((x["key"], x["check"]) for x in bad.problems) == sorted([
        ("b1_glaive/1", "ids"), ("b1_glaive/3", "source"), (f"b1_glaive/{recs[-1]['sample_id']}", "source"),
        ("b1_glaive/6", "mask"), ("b5_openthoughts/c/1#1", "source"), ("b5_openthoughts/201", "finite")])
    assert next(x for x in bad.problems if x["check"] == "finite")["detail"] == "1 NaN/Inf values"
    order = [str(k) for k in HiddenReader(hidden_dir(p)).keys()]
    assert [x["key"] for x in bad.problems] == sorted((x["key"] for x in bad.problems), key=order.index)

    reordered = Mix(None, mix.manifest, keys=[*mix.keys[1:], mix.keys[0]])  # the index is not the mix's order
    got = validate_store(p, mix=reordered)
    assert _verdict(got) == _in_memory_validation(p, Mix(mix.samples[1:] + mix.samples[:1], mix.manifest))
    assert got.problems[-1]["check"] == "coverage" and got.problems[:-1] == bad.problems

    with_view = Mix(None, mix.manifest, view=read_run(p.run_dir, verdicts=False), keys=mix.keys)  # a run in memory
    assert _verdict(validate_store(p, mix=with_view)) == _verdict(bad)

    one = _params(tmp_path, "varied", chunk, **{"hidden.datasets": ["b1_glaive"]})  # b5's records not asked for
    got = validate_store(one, mix=mix)
    assert _verdict(got) == _in_memory_validation(one, mix)
    assert {x["key"] for x in got.problems if x["check"] == "source"} >= {str(k) for k in mix.keys
                                                                           if k.dataset == "b5_openthoughts"}


def _validate_peak(p) -> tuple[int, object]:
    tracemalloc.start()
    try:
        v = validate_store(p)
        return tracemalloc.get_traced_memory()[1], v
    finally:
        tracemalloc.stop()


def test_validate_stores_memory_does_not_rise_with_the_number_of_samples(tmp_path):
    """Python's peak while 04 validates its store: set by `hidden.mix_chunk_rows`, not the run (what grows is a few
    small facts per sample: the index's rows, the mix's keys, the journal's line spans). The in-memory validation,
    measured the same way, grows by the records' ids."""
    n = 40
    runs = _runs(tmp_path, n)
    _validate_peak(runs[0])
    (small, vs), (large, vl) = _validate_peak(runs[1]), _validate_peak(runs[2])
    assert vs.ok and vl.ok and (vs.samples, vl.samples) == (n, 4 * n) and vl.tokens == 4 * n * 2001
    assert len(list(shard_dir(hidden_dir(runs[2])).glob("*.safetensors"))) > 1
    per_sample = (large - small) / (3 * n)  # 2.8 kB measured (2026-12-07)
    old = []
    for p in runs[1:]:
        tracemalloc.start()
        try:
            _in_memory_validation(p)
            old.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    old_per_sample = (old[1] - old[0]) / (3 * n)  # ~190 kB: every record's ids (and texts) as Python objects
    assert per_sample < 4000 and old_per_sample > 25 * per_sample, (small, large, per_sample, old, old_per_sample)
