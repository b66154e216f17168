"""The store's one index: the finished files found on disk (`scan_shards`, partial ones discarded), which stored copy
is each mix sample's (`match_stored`: its key and its ids), and `index.parquet` + `index.json` of the mix's samples
in mix order (`index_rows`, `write_index`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import orjson

from eagle3data.core.atomic import atomic_path, tmp_tag, write_atomic
from eagle3data.core.quant import StateCodec
from eagle3data.core.reader import Sample, SampleKey
from eagle3data.hidden.store.checksum import ALGORITHM, ids_digest, store_checksums
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

    def copies(self) -> dict[SampleKey, list[tuple[str, dict[str, Any]]]]:
        """Each stored key's copies, (file, entry), files in name order."""
        out: dict[SampleKey, list[tuple[str, dict[str, Any]]]] = {}
        for f, entries in sorted(self.shards.items()):
            for e in entries:
                out.setdefault(SampleKey.of(e), []).append((f, e))
        return out


@dataclass
class StoredMatch:
    """Which stored copy is each sample's: `chosen` (key -> (file, entry)): the first file by name whose copy holds the
    sample's own ids (its `ids_digest`; a file written before digests: the same token count); `stale`: keys stored only
    with other ids (01 or 02 ran again since: extracted again, never indexed); `duplicates`: other copies with the
    sample's ids; `by_length`: chosen copies compared by token count only."""

    chosen: dict[SampleKey, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    stale: list[SampleKey] = field(default_factory=list)
    stale_copies: int = 0
    duplicates: int = 0
    by_length: int = 0

    def line(self) -> str | None:
        """04's one line on stored samples that are not the mix's any more, and on those compared by token count only
        (None when neither)."""
        n, k = len(self.stale), self.by_length
        parts = ([f"{n} stored sample{'s' if n != 1 else ''} held other ids than the mix (01 or 02 ran again since): "
                  f"extracted again, the stale cop{'ies' if n != 1 else 'y'} left out of the index (e.g. {self.stale[0]})"]
                 if n else []) + ([f"{k} stored sample{'s' if k != 1 else ''} without an ids digest (written before "
                                   "digests) resumed by token count only"] if k else [])
        return "04: " + "; ".join(parts) if parts else None


def match_stored(scan: ShardScan, samples: Sequence[Sample]) -> StoredMatch:
    """The stored copy of each of `samples` (`StoredMatch`): a copy counts only when it holds the sample's ids."""
    copies, m = scan.copies(), StoredMatch()
    for s in samples:
        got = copies.get(s.key)
        if not got:
            continue
        digest = ids_digest(s.input_ids)
        same = [c for c in got if c[1].get("ids_digest") == digest]
        old = [c for c in got if c[1].get("ids_digest") is None and int(c[1].get("length", -1)) == len(s.input_ids)]
        good = same + old
        m.stale_copies += len(got) - len(good)
        if not good:
            m.stale.append(s.key)
            continue
        m.chosen[s.key] = good[0]
        m.duplicates += len(good) - 1
        m.by_length += not same
    return m


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

    Each mix sample appears once, from its copy that holds its ids (`match_stored`: a sample found in two files
    with its ids, e.g. after the world size changed mid-run, is indexed from the first file by name and counted as a
    duplicate); stored samples no longer in the mix, and copies of a mix key with other ids, are left out and
    counted as stale.
    """
    want = {s.key: i for i, s in enumerate(samples)}
    m = match_stored(scan, samples)
    stale = m.stale_copies + sum(len(es) for k, es in scan.copies().items() if k not in want)
    rows = [{**e, "key": str(k), "turn": k.turn, "position": want[k], "shard": f} for k, (f, e) in m.chosen.items()]
    missing = [str(k) for k in want if k not in m.chosen]
    return sorted(rows, key=lambda r: r["position"]), missing, m.duplicates, stale


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
