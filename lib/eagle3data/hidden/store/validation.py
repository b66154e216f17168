"""04's validation of the store: every stored sample re-read (through `HiddenReader`) against the run's records:
shape, dtype, finite, ids and mask, and the mix's coverage; the records read a chunk of keys at a time through the
journals' index (`RunSources`), never the whole run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3data.core.params import RunParams
from eagle3data.core.reader import COMPLETED, RunView, Sample, SampleKey, resolve
from eagle3data.core.stream import index_journal, index_rebuilt
from eagle3data.hidden.mix import Mix, MixError, _chosen, hidden_dir, read_mix
from eagle3data.hidden.mix.rows import Records
from eagle3data.hidden.store.format import _torch_dtype
from eagle3data.hidden.store.reader import HiddenReader


@dataclass
class Validation:
    """Problems found re-reading every stored sample (empty = the store is sound)."""

    samples: int
    tokens: int
    problems: list[dict[str, Any]]
    mix_samples: int
    too_long: int

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self):
        import pandas as pd

        return pd.DataFrame(self.problems, columns=["dataset", "sample_id", "check", "detail"])

    def summary(self):
        import pandas as pd

        return pd.DataFrame({"value": pd.Series({
            "samples checked": self.samples, "tokens checked": self.tokens, "mix samples": self.mix_samples,
            "skipped (too long)": self.too_long, "problems": len(self.problems), "ok": self.ok}, dtype=object)})


def sample_problems(smp: dict[str, Any], src: Sample | None, states_hidden: tuple[int, int],
                    dtype: Any, finite: bool = True) -> list[tuple[str, str]]:
    """One stored sample's (check, detail) problems: shape and dtype, finite (unless `finite` is False: the
    caller counts NaN/Inf itself), lengths, ids and mask vs its record."""
    return (state_problems(smp, states_hidden, dtype, finite)
            + record_problems(smp["input_ids"], smp["loss_mask"], src))


def state_problems(smp: dict[str, Any], states_hidden: tuple[int, int], dtype: Any,
                   finite: bool = True) -> list[tuple[str, str]]:
    """`sample_problems`' checks of the sample alone: shape and dtype, finite, lengths."""
    import torch

    n = int(smp["length"])
    hs, ids, mask = smp["hidden_states"], smp["input_ids"], smp["loss_mask"]
    out: list[tuple[str, str]] = []
    want = (n, *states_hidden)
    if tuple(hs.shape) != want or hs.dtype != dtype:
        out.append(("shape", f"{tuple(hs.shape)} {hs.dtype}, expected {want} {dtype}"))
    elif finite and not bool(torch.isfinite(hs).all()):
        out.append(("finite", f"{int((~torch.isfinite(hs)).sum())} NaN/Inf values"))
    if len(ids) != n or len(mask) != n:
        out.append(("mask_length", f"{len(ids)} ids, {len(mask)} mask values for {n} states"))
    return out


def record_problems(ids: Any, mask: Any, src: Sample | None) -> list[tuple[str, str]]:
    """`sample_problems`' checks against the sample's record: found, the same ids, the same mask."""
    if src is None:
        return [("source", "not found in the run's records / reconstruct files")]
    out: list[tuple[str, str]] = []
    if ids.tolist() != src.input_ids:
        out.append(("ids", "stored input_ids differ from the source record"))
    if mask.tolist() != src.loss_mask:
        out.append(("mask", "stored loss_mask differs from the source record"))
    return out


class RunSources:
    """The run's sequence of each key, as `mix.source_sequences` gives it (the key's record, completed, resolved with
    02's rebuilt ids; None when there is none), for a list of keys at a time: read from the journals' index
    (`core.stream`: per line its span, key and the supersede verdict) by seek, forward through each journal, so only
    the asked keys' lines are ever parsed. With a run view already in memory (`view`), read from it."""

    def __init__(self, params: RunParams, view: RunView | None = None) -> None:
        names = _chosen(params)
        self.view = None if view is None else view.samples(names)
        if view is None:
            journals = {n: index_journal(params.run_dir, n, MixError) for n in names}
            self.records, self.rebuilt = Records(journals), index_rebuilt(params.run_dir, names, MixError)

    def __call__(self, keys: list[SampleKey]) -> list[Sample | None]:
        if self.view is not None:
            return [self.view.get(k) for k in keys]
        known = [i for i, k in enumerate(keys) if k in self.records]  # a key of another dataset has no record here
        out: list[Sample | None] = [None] * len(keys)
        for i, rec in zip(known, self.records([keys[i] for i in known])):
            if rec is not None and rec.get("finish_reason") in COMPLETED:
                out[i] = resolve(rec, self.rebuilt)
        return out


def validate_store(params: RunParams, *, mix: Mix | None = None) -> Validation:
    """Re-read every sample: shape [n, states, hidden], finite, ids and mask equal to the source records, coverage.

    Streamed: the stored samples are read shard by shard and checked as they come; their ids and masks wait, at most
    `hidden.mix_chunk_rows` of them, for their records, read together (`RunSources`), so memory is that chunk, not the
    run. The mix is asked only for its keys."""
    hdir = hidden_dir(params)
    reader = HiddenReader(hdir)
    mix = mix or read_mix(hdir)
    sources = RunSources(params, mix.view)  # the records, through the journals' index (read once per stage)
    chunk = max(1, int(params.hidden.mix_chunk_rows))
    hsize, dtype = reader.info["hidden_size"], _torch_dtype(reader.info["dtype"])
    problems: list[dict[str, Any]] = []
    waiting: list[tuple[SampleKey, str, str, list[tuple[str, str]], Any, Any]] = []

    def check_waiting() -> None:  # the waiting samples against their records, in the order they were read
        for (key, dataset, sid, found, ids, mask), src in zip(waiting, sources([w[0] for w in waiting])):
            for check, detail in found + record_problems(ids, mask, src):
                problems.append({"key": str(key), "dataset": dataset, "sample_id": sid, "check": check,
                                 "detail": detail})
        waiting.clear()

    seen = 0
    tokens = 0
    for smp in reader:
        seen += 1
        tokens += int(smp["length"])
        found = state_problems(smp, (len(reader.states), hsize), dtype)
        waiting.append((SampleKey.of(smp), smp["dataset"], smp["sample_id"], found, smp["input_ids"].clone(),
                        smp["loss_mask"].clone()))  # clones: the shard's tensors are not kept
        if len(waiting) >= chunk:
            check_waiting()
    check_waiting()
    too_long = len(reader.info.get("too_long", []))
    keys = [str(k) for k in mix.keys]
    if seen != len(keys) or reader.keys() != keys:
        problems.append({"key": "*", "dataset": "*", "sample_id": "*", "check": "coverage",
                         "detail": f"{seen} stored samples, {len(keys)} in the mix: the index must hold "
                                   "exactly the mix's keys in mix order"})
    return Validation(seen, tokens, problems, len(keys), too_long)
