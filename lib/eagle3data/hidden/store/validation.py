"""04's validation of the store: every stored sample re-read (through `HiddenReader`) against the run's records:
shape, dtype, finite, ids and mask, and the mix's coverage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3data.core.params import RunParams
from eagle3data.core.reader import Sample, SampleKey
from eagle3data.hidden.mix import Mix, hidden_dir, read_mix, source_sequences
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
    if src is None:
        out.append(("source", "not found in the run's records / reconstruct files"))
    else:
        if ids.tolist() != src.input_ids:
            out.append(("ids", "stored input_ids differ from the source record"))
        if mask.tolist() != src.loss_mask:
            out.append(("mask", "stored loss_mask differs from the source record"))
    return out


def validate_store(params: RunParams, *, mix: Mix | None = None) -> Validation:
    """Re-read every sample: shape [n, states, hidden], finite, ids and mask equal to the source records, coverage."""
    hdir = hidden_dir(params)
    reader = HiddenReader(hdir)
    mix = mix or read_mix(hdir)
    sources = source_sequences(params, mix.view)  # the records, through the one reader (read once per stage)
    hsize, dtype = reader.info["hidden_size"], _torch_dtype(reader.info["dtype"])
    problems: list[dict[str, Any]] = []

    def bad(row: dict[str, Any], check: str, detail: str) -> None:
        problems.append({"key": str(SampleKey.of(row)), "dataset": row["dataset"], "sample_id": row["sample_id"],
                         "check": check, "detail": detail})

    seen = 0
    tokens = 0
    for smp in reader:
        seen += 1
        tokens += int(smp["length"])
        for check, detail in sample_problems(smp, sources.get(SampleKey.of(smp)), (len(reader.states), hsize), dtype):
            bad(smp, check, detail)
    too_long = len(reader.info.get("too_long", []))
    if seen != len(mix.samples) or reader.keys() != [str(s.key) for s in mix.samples]:
        problems.append({"key": "*", "dataset": "*", "sample_id": "*", "check": "coverage",
                         "detail": f"{seen} stored samples, {len(mix.samples)} in the mix: the index must hold "
                                   "exactly the mix's keys in mix order"})
    return Validation(seen, tokens, problems, len(mix.samples), too_long)
