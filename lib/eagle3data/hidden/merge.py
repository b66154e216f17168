"""Stage 04's one index: `merge_store` (`extract.merge_index` for the model) builds `index.parquet` and `index.json` from every worker's finished shards.

`extract --merge-only` and the last worker of `run_extract` call it. The verification that
`verify-hidden` recorded in `index.json` is carried over when the merged store is provably the
one verified (`verify.record.store_fingerprint`: the same index rows, files, sizes and modification
times, and the same kind of store); otherwise it is dropped, and 05 refuses until verify-hidden runs again.
"""

from __future__ import annotations

from typing import Any

import orjson

from eagle3data.core.params import RunParams
from eagle3data.core.profiles import AuxLayers
from eagle3data.hidden.mix import Mix, hidden_dir, read_mix
from eagle3data.hidden.store.failures import drop_failed, read_failures, require_samples
from eagle3data.hidden.store.format import INFO_FILE, HiddenError, state_names
from eagle3data.hidden.store.index import index_rows, scan_shards, write_index
from eagle3data.hidden.verify.record import keep_verification


class IncompleteError(HiddenError):
    """Some samples of the mix are not stored yet (other workers still running, or a stopped run)."""

    def __init__(self, msg: str, missing: int):
        super().__init__(msg)
        self.missing = missing


def merge_store(params: RunParams, layers: AuxLayers, hidden_size: int, *, mix: Mix | None = None,
                allow_partial: bool = False) -> Any:
    """Build the one `index.parquet` (+ `index.json`) from every worker's finished shards (`store.index.write_index`),
    for a store of `layers` (the model's layer plan) and `hidden_size`; `extract.merge_index` is this for the model.

    Each mix sample appears once, from a copy that holds its mix ids (`index.match_stored`: a sample found in two
    shards with them, e.g. after the world size changed mid-run, is indexed from the first shard by name and counted
    as a duplicate); shard samples no longer in the mix, and copies of a mix key stored with other ids (01 or 02 ran
    again since), are left out and counted as stale. MixEmpty when the mix holds no sample. Raises
    IncompleteError while samples are missing, unless `allow_partial`, or unless each missing one is a sample a
    worker failed (`failures.read_failures`) and they are at most `hidden.allow_failed_samples`: those leave the
    mix (`failures.drop_failed`: drop reason `capture_failed`) and are named in `index.json` (`failed_samples`). A
    verification of the same store is kept (module docstring).
    """
    hdir = hidden_dir(params)
    mix = mix or read_mix(hdir)
    too_long = [d for d in mix.dropped if d["reason"] == "too_long"]  # reported here too; never in the mix
    scan = scan_shards(hdir)
    states = state_names(params.hidden.final_state)
    scan.check_kind(params.hidden.layout, states, hdir, params.hidden.codec())
    rows, missing, duplicates, stale = index_rows(scan, mix.samples)
    accepted: list[dict[str, Any]] = []
    if missing and not allow_partial:
        failed = read_failures(hdir)
        allow = params.hidden.allow_failed_samples
        if allow and len(missing) <= allow and all(k in failed for k in missing):  # failed, and accepted: out of the mix
            accepted = [{k: v for k, v in failed[k].items() if k != "file"} for k in missing]
            mix = drop_failed(mix, accepted, hdir)
            rows, missing, duplicates, stale = index_rows(scan, mix.samples)
    require_samples(mix, hdir)  # an empty mix (every record dropped, or every sample failed) merges no index
    if missing and not allow_partial:
        raise IncompleteError(f"{len(missing)} of {len(mix.samples)} mix samples are not stored yet "
                              f"(e.g. {missing[:3]}): other workers still running, or resume this one", len(missing))
    run = {"model": params.model.name, "profile": params.profile, "num_layers": layers.num_layers,
           "hf_indices": list(layers.hf_indices), "layer_outputs": list(layers.layer_outputs),
           "states": list(states), "final_state": params.hidden.final_state, "layout": params.hidden.layout,
           "hidden_size": int(hidden_size), "dtype": params.hidden.dtype,
           "storage": params.hidden.codec().as_dict()}
    before = orjson.loads((hdir / INFO_FILE).read_bytes()) if (hdir / INFO_FILE).exists() else {}
    df = write_index(hdir, rows, scan, run, {
        "too_long": too_long, "missing": len(missing), "duplicates_not_indexed": duplicates,
        "stale_not_indexed": stale, "mix_fingerprint": mix.manifest.get("fingerprint"),
        "failed_samples": accepted})
    keep_verification(hdir, before)
    return df
