"""The store's one index: the finished files found on disk (`scan_shards`, partial ones discarded), and
`index.parquet` + `index.json` of the mix's samples in mix order (`index_rows`, `write_index`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import orjson

from eagle3data.core.atomic import atomic_path, write_atomic
from eagle3data.core.quant import StateCodec
from eagle3data.core.reader import Sample, SampleKey
from eagle3data.hidden.mix import tmp_tag
from eagle3data.hidden.store.checksum import ALGORITHM, store_checksums
from eagle3data.hidden.store.format import (INDEX_COLUMNS, INDEX_FILE, INFO_FILE, OLD_STATES, SHARD_SUFFIX, HiddenError,
                                           read_shard_meta, sample_dir, shard_dir, stored_bytes_per_token)
from eagle3data.trainers.registry import trainer_for_suffix


@dataclass
class ShardScan:
    """Finished shards found on disk, the samples they hold, and partial shards discarded."""

    shards: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # file (relative to hidden/) -> samples
    discarded: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    kinds: dict[tuple[str, tuple[str, ...], StateCodec], str] = field(default_factory=dict)  # kind -> a file

    def check_kind(self, layout: str, states: tuple[str, ...], where: Path, codec: StateCodec | None = None) -> None:
        """Refuse a store written with another layout, other states or another storage than the params ask for."""
        codec = codec or StateCodec(len(states))
        other = {k: f for k, f in self.kinds.items() if k != (layout, tuple(states), codec)}
        if other:
            (lay, st, cod), f = next(iter(other.items()))
            raise HiddenError(
                f"{where / f}: stored as layout {lay!r} with states {list(st)} in storage {cod.as_dict()}, but "
                f"hidden.layout={layout!r}, hidden.final_state and hidden.storage ask for {list(states)} in "
                f"{codec.as_dict()}: set them as the store was written, or delete {where} "
                "(or point hidden.out_dir elsewhere) to extract again")

    def done_keys(self) -> set[str]:
        return {SampleKey.of(e) for es in self.shards.values() for e in es}


def _file_kind(meta: dict[str, Any]) -> tuple[str, tuple[str, ...], StateCodec]:
    # stores written before `hidden.final_state` named the post-norm state `final_norm`
    states = tuple(meta.get("states") or OLD_STATES)
    return meta.get("layout", "shards"), states, StateCodec.of_info(meta, len(states))


def scan_shards(hdir: Path, *, discard_for_rank: int | None = None, discard_all: bool = False) -> ShardScan:
    """Read every finished shard's header; delete partial shards of `discard_for_rank` (or all).

    A partial shard is a `.tmp` left by a crash mid-write, or a finished name whose header
    or data does not read back (truncated file). Other ranks' files are left alone: they may
    be writing right now.
    """
    scan = ShardScan()

    def mine(p: Path) -> bool:
        if discard_all:
            return True
        if discard_for_rank is None:
            return False
        tag = f"r{discard_for_rank:03d}"
        # shards are named r<rank>-N; a per-sample file's .tmp carries its writer's rank (p<pos>-<tag>.<ext>.r<rank>.tmp)
        return p.name.startswith(tag + "-") or p.name.endswith(f".{tag}.tmp")

    for d, pattern in ((shard_dir(hdir), "*" + SHARD_SUFFIX), (sample_dir(hdir), "p*")):
        if not d.exists():
            continue
        for p in sorted(d.glob("*.tmp")):
            if mine(p):
                p.unlink(missing_ok=True)
                scan.discarded.append(p.name)
        for p in sorted(d.glob(pattern)):
            if p.suffix != SHARD_SUFFIX and trainer_for_suffix(p.suffix) is None:
                continue
            try:
                meta = read_shard_meta(p)  # safetensors / torch refuse a file shorter than its header says
            except Exception:  # noqa: BLE001 - any unreadable file is partial
                if mine(p):
                    p.unlink(missing_ok=True)
                    scan.discarded.append(p.name)
                else:
                    scan.unreadable.append(p.name)
                continue
            rel = f"{d.name}/{p.name}"
            scan.shards[rel] = meta["samples"]
            scan.kinds.setdefault(_file_kind(meta), rel)
    return scan


def index_rows(scan: ShardScan, samples: Sequence[Sample]) -> tuple[list[dict[str, Any]], list[str], int, int]:
    """The index rows of the mix `samples` found in the stored files, in mix order: (rows, missing keys,
    duplicates, stale).

    Each mix sample appears once (a sample found in two files, e.g. after the world size
    changed mid-run, is indexed from the first file by name and counted as a duplicate); stored
    samples no longer in the mix are left out and counted as stale.
    """
    want = {s.key: i for i, s in enumerate(samples)}
    rows: dict[str, dict[str, Any]] = {}
    duplicates = stale = 0
    for shard, entries in sorted(scan.shards.items()):
        for e in entries:
            k = SampleKey.of(e)
            if k not in want:
                stale += 1
                continue
            if k in rows:
                duplicates += 1
                continue
            rows[k] = {**e, "key": str(k), "turn": k.turn, "position": want[k], "shard": shard}
    missing = [str(k) for k in want if k not in rows]
    return sorted(rows.values(), key=lambda r: r["position"]), missing, duplicates, stale


def write_index(hdir: Path, rows: list[dict[str, Any]], scan: ShardScan, run: dict[str, Any],
                extra: dict[str, Any]) -> Any:
    """Write `index.parquet` (these rows) and `index.json` atomically; return the index frame.

    `run`: what was stored (model, profile, layers, states, final_state, layout, hidden_size,
    dtype); `index.json` is `run`, the index's sizes and files, the checksum's algorithm, then `extra`
    (too long, missing, duplicates, stale, the mix's fingerprint). Each row's `checksum` is its file's
    (`checksum.store_checksums`; no column for a store written before checksums).
    """
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    df = pd.DataFrame(rows, columns=INDEX_COLUMNS)
    df = df.astype({"turn": "Int32", "position": "int64", "offset": "int64", "length": "int64",
                    "loss_tokens": "int64"})
    sums = store_checksums(hdir, sorted(set(df["shard"])))  # None: a store written before checksums
    if sums is not None:
        df["checksum"] = [sums[f] for f in df["shard"]]
    tag = tmp_tag()
    with atomic_path(hdir / INDEX_FILE, tmp_suffix=tag) as tmp:
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), str(tmp))
    info = {
        **run, "samples": int(len(df)), "tokens": int(df["length"].sum()), "loss_tokens": int(df["loss_tokens"].sum()),
        "bytes_per_token": stored_bytes_per_token(run),
        "shards": sorted(scan.shards), "shard_file_bytes": sum((hdir / s).stat().st_size for s in scan.shards),
        "checksum": ALGORITHM if sums is not None else None, **extra,
    }
    write_atomic(hdir / INFO_FILE, orjson.dumps(info, option=orjson.OPT_INDENT_2), tmp_suffix=tag)
    return df
