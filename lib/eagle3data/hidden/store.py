"""04's store on disk, written and read here only: shards or per-sample trainer files, the index, the reader.

What 04 writes (`<run>/hidden/` or `hidden.out_dir`, beside the mix of `mix.py`; `extract`
captures the states and hands them to the writers here):
- `shards/rRRR-NNNNN.safetensors`: `hidden_states` [tokens, S, hidden] (bf16 by default; S =
  the states of `hidden.final_state`, `state_names`), `input_ids` [tokens] int32, `loss_mask`
  [tokens] uint8, samples concatenated; the shard's metadata lists its samples (offset,
  length) so shards describe themselves. A shard is written to `.tmp` and renamed when
  complete: a crash leaves at most a `.tmp`, which the next run discards and redoes.
- or, with `hidden.layout` a trainer's name (`specforge` / `speculators`), one file per sample
  in that trainer's own format under `samples/` (`p<position><suffix>`, written and read by
  the trainer's module in `eagle3data.trainers`), each with the same `eagle3data` metadata.
  The 05 hand-off hardlinks these files into the trainer's folder instead of copying them.
- `index.parquet` (one row per sample: key, dataset, sample_id, turn, source, ids_exact,
  position in the mix, shard (file), offset, length, loss_tokens) and `index.json` (layers,
  states, sizes, skipped), the one index of the mix's samples in mix order (`write_index`).

`HiddenReader` reads a sample by key or row whatever the layout; `validate_store` re-reads
every sample against the run's records (through the one reader).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import orjson

from eagle3data.core.atomic import atomic_path, write_atomic
from eagle3data.core.errors import UserInputError
from eagle3data.core.params import RunParams
from eagle3data.core.quant import StateCodec
from eagle3data.core.readahead import will_need
from eagle3data.core.reader import Sample, SampleKey
from eagle3data.hidden.mix import Mix, hidden_dir, read_mix, source_sequences, tmp_tag
from eagle3data.trainers.base import AUX_STATES, Trainer
from eagle3data.trainers.registry import get_trainer, trainer_for_suffix


class HiddenError(UserInputError, RuntimeError):
    """04 cannot run or cannot trust what it wrote; the message says what to do."""


class HiddenMissing(HiddenError, FileNotFoundError):
    """No hidden-state store (index) where one is needed (a user error: one line, exit 2)."""


SHARD_DIR = "shards"
SAMPLE_DIR = "samples"
SHARD_SUFFIX = ".safetensors"
INDEX_FILE = "index.parquet"
INFO_FILE = "index.json"
AUX_NAMES = ("aux_low", "aux_mid", "aux_high")
FINAL_NAMES = {"pre_norm": ("pre_norm",), "post_norm": ("post_norm",), "both": ("pre_norm", "post_norm")}
OLD_STATES = ("aux_low", "aux_mid", "aux_high", "final_norm")  # stores written before `hidden.final_state`
SHARD_ID_MASK_BYTES = 4 + 1  # a shard's input id int32 + loss mask uint8 per token
INDEX_COLUMNS = ["key", "dataset", "sample_id", "turn", "source", "ids_exact", "position", "shard", "offset",
                 "length", "loss_tokens"]
assert len(AUX_NAMES) == AUX_STATES


def state_names(final_state: str = "both") -> tuple[str, ...]:
    """The states stored per token, in order: the three aux layers, then the final state(s)."""
    if final_state not in FINAL_NAMES:
        raise HiddenError(f"unknown final_state {final_state!r}; one of {', '.join(FINAL_NAMES)}")
    return AUX_NAMES + FINAL_NAMES[final_state]


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def id_mask_bytes(layout: str) -> int:
    """Bytes of (input id, loss mask) per token in a layout: shards int32 + uint8, else the trainer's own."""
    return SHARD_ID_MASK_BYTES if layout == "shards" else get_trainer(layout).id_mask_bytes


def bytes_per_token(hidden_size: int, dtype: str = "bfloat16", states: int = 4, layout: str = "shards",
                    codec: StateCodec | None = None) -> int:
    """Bytes one token takes on disk: its states (states x hidden x dtype size, or the 8-bit `codec`'s values and
    scales), plus its id and mask (per layout)."""
    if codec is not None and codec.quantized:
        state = codec.bytes_per_token(hidden_size) if layout == "shards" else \
            get_trainer(layout).state_bytes_per_token(codec, hidden_size)
        return state + id_mask_bytes(layout)
    return states * hidden_size * _torch_dtype(dtype).itemsize + id_mask_bytes(layout)


def stored_bytes_per_token(info: dict[str, Any]) -> int:
    """Bytes per token of a store (or stage) by its description: hidden_size, dtype, states, layout, storage."""
    return bytes_per_token(info["hidden_size"], info["dtype"], len(info["states"]), info["layout"],
                           StateCodec.of_info(info, len(info["states"])))


def split_states(states: Any, names: Sequence[str]) -> tuple[Any, dict[str, Any]]:
    """A sample's states [n, S, H] (ordered as `names`) as the aux states [n, 3, H] and {final name: [n, H]}."""
    return states[:, : len(AUX_NAMES)], {x: states[:, i] for i, x in enumerate(names) if i >= len(AUX_NAMES)}


# ---------------------------------------------------------------------------- files


def shard_dir(hdir: Path) -> Path:
    return hdir / SHARD_DIR


def sample_dir(hdir: Path) -> Path:
    """Per-sample files of a trainer's layout."""
    return hdir / SAMPLE_DIR


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


def index_entry(s: Sample, position: int, offset: int) -> dict[str, Any]:
    """A stored sample's index row: its key (and the row it is made from: dataset, sample_id, turn), where it lies."""
    return {"key": str(s.key), "dataset": s.dataset, "sample_id": s.sample_id, "turn": s.turn, "source": s.source,
            "ids_exact": s.ids_exact, "position": position, "offset": offset, "length": len(s.input_ids),
            "loss_tokens": int(sum(s.loss_mask))}


def read_shard_meta(path: Path) -> dict[str, Any]:
    """A shard's (or per-sample file's) own description (samples with offset and length, layers, states, dtype)."""
    path = Path(path)
    trainer = trainer_for_suffix(path.suffix) if path.parent.name == SAMPLE_DIR or path.suffix != SHARD_SUFFIX else None
    if trainer is not None:
        raw = trainer.read_meta(path)
    else:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("eagle3data")
    if raw is None:
        raise HiddenError(f"{path}: not an eagle3data shard (no `eagle3data` metadata)")
    return orjson.loads(raw)


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
        # shards are named r<rank>-N; a per-sample file's .tmp carries its writer's rank (p<pos>.<ext>.r<rank>.tmp)
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


class ShardWriter:
    """Accumulates samples in memory and writes a shard when the next one would pass the size cap."""

    def __init__(self, hdir: Path, rank: int, shard_bytes: int, info: dict[str, Any]):
        self.dir = shard_dir(hdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.cap = shard_bytes
        self.info = info
        self.codec = StateCodec.of_info(info, len(info["states"]))
        self.state_bytes = self.codec.bytes_per_token(int(info["hidden_size"]))
        nums = [int(p.name.split("-")[1].split(".")[0]) for p in self.dir.glob(f"r{rank:03d}-*{SHARD_SUFFIX}")]
        self.next_no = max(nums, default=-1) + 1
        self.written: list[str] = []
        self._reset()

    def _reset(self) -> None:
        self.states: list[Any] = []
        self.ids: list[Any] = []
        self.masks: list[Any] = []
        self.entries: list[dict[str, Any]] = []
        self.tokens = 0
        self.bytes = 0

    def add(self, s: Sample, position: int, states: Any) -> None:
        """Queue one sample's states `[n, S, hidden]` (CPU, storage dtype) with its ids and mask."""
        import torch

        n = len(s.input_ids)
        if states.shape[0] != n:
            raise HiddenError(f"{s.key}: {states.shape[0]} states for {n} tokens")
        nbytes = (self.state_bytes + SHARD_ID_MASK_BYTES) * n
        if self.entries and self.bytes + nbytes > self.cap:
            self.flush()
        self.entries.append(index_entry(s, position, self.tokens))
        self.states.append(states)
        self.ids.append(torch.tensor(s.input_ids, dtype=torch.int32))
        self.masks.append(torch.tensor(s.loss_mask, dtype=torch.uint8))
        self.tokens += n
        self.bytes += nbytes

    def flush(self) -> str | None:
        """Write the queued samples as one shard (`.tmp`, fsync, rename); return its name."""
        import torch
        from safetensors.torch import save_file

        if not self.entries:
            return None
        name = f"r{self.rank:03d}-{self.next_no:05d}{SHARD_SUFFIX}"
        tensors = {**self.codec.encode(torch.cat(self.states)), "input_ids": torch.cat(self.ids),
                   "loss_mask": torch.cat(self.masks)}
        meta = {**self.info, "rank": self.rank, "samples": self.entries, "tokens": self.tokens}
        with atomic_path(self.dir / name, fsync=True) as tmp:  # the umask's mode: save_file alone makes it 0600
            save_file(tensors, str(tmp), metadata={"eagle3data": orjson.dumps(meta).decode()})
        self.written.append(name)
        self.next_no += 1
        self._reset()
        return name


class SampleFileWriter:
    """Writes each sample at once as one file in a trainer's own format (`hidden.layout` a trainer's name).

    `samples/p<position><suffix>`, written by the trainer's module (`Trainer.write_sample`)
    with every final state the store holds and the shard metadata (one sample, offset 0):
    the same key `eagle3data`. Written to `.r<rank>.tmp`, fsynced, renamed.
    """

    def __init__(self, hdir: Path, rank: int, layout: str, info: dict[str, Any]):
        self.dir = sample_dir(hdir)
        self.rank = rank
        self.trainer: Trainer = get_trainer(layout)
        self.info = info
        self.names: tuple[str, ...] = tuple(info["states"])
        codec = StateCodec.of_info(info, len(self.names))
        self.storage = codec.aux if codec.quantized else None  # one storage for all states (params check it)
        need = self.trainer.final_state
        if need not in self.names:
            raise HiddenError(f"{self.dir}: the store holds {list(self.names)}, but {layout} needs the {need} state: "
                              f"rerun 04 with hidden.final_state {need!r} or 'both'")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.written: list[str] = []
        self.entries: list[dict[str, Any]] = []  # always empty: nothing waits in memory
        self.tokens = 0

    def add(self, s: Sample, position: int, states: Any) -> None:
        n = len(s.input_ids)
        if states.shape[0] != n:
            raise HiddenError(f"{s.key}: {states.shape[0]} states for {n} tokens")
        entry = index_entry(s, position, 0)
        meta = orjson.dumps({**self.info, "rank": self.rank, "samples": [entry], "tokens": n}).decode()
        name = f"p{position:09d}{self.trainer.sample_suffix}"
        aux, finals = split_states(states, self.names)
        self.trainer.write_sample(self.dir / name, s.input_ids, s.loss_mask, aux, finals, meta,
                                  tmp_suffix=f".r{self.rank:03d}.tmp", storage=self.storage)
        self.written.append(name)

    def flush(self) -> None:
        return None


def open_writer(hdir: Path, rank: int, layout: str, shard_bytes: int,
                info: dict[str, Any]) -> ShardWriter | SampleFileWriter:
    """The writer of one worker's files in `layout`: shards up to `shard_bytes`, or a trainer's per-sample files."""
    if layout == "shards":
        return ShardWriter(hdir, rank, shard_bytes, info)
    return SampleFileWriter(hdir, rank, layout, info)


# ---------------------------------------------------------------------------- index


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
    dtype); `index.json` is `run`, the index's sizes and files, then `extra` (too long,
    missing, duplicates, stale, the mix's fingerprint).
    """
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    df = pd.DataFrame(rows, columns=INDEX_COLUMNS)
    df = df.astype({"turn": "Int32", "position": "int64", "offset": "int64", "length": "int64",
                    "loss_tokens": "int64"})
    tag = tmp_tag()
    with atomic_path(hdir / INDEX_FILE, tmp_suffix=tag) as tmp:
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), str(tmp))
    info = {
        **run, "samples": int(len(df)), "tokens": int(df["length"].sum()), "loss_tokens": int(df["loss_tokens"].sum()),
        "bytes_per_token": stored_bytes_per_token(run),
        "shards": sorted(scan.shards), "shard_file_bytes": sum((hdir / s).stat().st_size for s in scan.shards),
        **extra,
    }
    write_atomic(hdir / INFO_FILE, orjson.dumps(info, option=orjson.OPT_INDENT_2), tmp_suffix=tag)
    return df


# ---------------------------------------------------------------------------- reader


class HiddenReader:
    """Read a stored run: one sample by key or row, or stream all shard by shard.

    Each sample is a dict with `hidden_states` [n, S, hidden] (aux low, mid, high, then the
    final state(s) named in `info["states"]`), `input_ids` [n] int32, `loss_mask` [n] uint8,
    and its index row's fields, whatever the store's layout (shards or per-sample files).
    """

    def __init__(self, path: str | Path):
        import pandas as pd

        self.dir = Path(path)
        if not (self.dir / INDEX_FILE).exists():
            raise HiddenMissing(f"no index at {self.dir / INDEX_FILE}: run 04 first (eagle3data run PARAMS --only 04, "
                                "or eagle3data extract PARAMS --merge-only when every worker finished)")
        self.index: pd.DataFrame = pd.read_parquet(self.dir / INDEX_FILE)
        self.info: dict[str, Any] = orjson.loads((self.dir / INFO_FILE).read_bytes())
        self._rows = {str(k): i for i, k in enumerate(SampleKey.of_frame(self.index))}
        self.states: tuple[str, ...] = tuple(self.info.get("states") or OLD_STATES)
        self.layout: str = self.info.get("layout", "shards")
        self.codec = StateCodec.of_info(self.info, len(self.states))
        self.dtype = _torch_dtype(self.info.get("dtype", "bfloat16"))  # 8-bit stores are dequantized to it

    def files(self) -> list[str]:
        """The store's files in the order `chunks` reads them: shards sorted by name, per-sample files in mix order."""
        names = self.index["shard"].tolist()
        return sorted(set(names)) if self.layout == "shards" else names

    def prefetch(self, files: int = 2) -> None:
        """Start the kernel reading the first `files` files `chunks` reads (`will_need`), so work done before the first
        sample is read (a verification's setup) overlaps the disk."""
        will_need(*(self.dir / f for f in self.files()[:files]))

    def row(self, key: str | SampleKey) -> int | None:
        """The row number (mix order) of a stored sample's key, or None when it is not stored."""
        return self._rows.get(str(key))

    def path(self, which: int | str) -> Path:
        """The file holding one sample (a shard, or the sample's own file)."""
        i = self._rows[which] if isinstance(which, str) else int(which)
        return self.dir / self.index.iloc[i]["shard"]

    def __len__(self) -> int:
        return len(self.index)

    def keys(self) -> list[str]:
        """`dataset/sample_id` of each stored sample, in mix order."""
        return list(self._rows)

    def _read_file(self, path: Path) -> dict[str, Any]:
        """A per-sample file's states in the store's order, `input_ids` int32, `loss_mask` uint8."""
        import torch

        got = get_trainer(self.layout).read_sample(path)
        finals = [got["finals"].get(x) for x in self.states[len(AUX_NAMES):]]
        if any(t is None for t in finals):
            raise HiddenError(f"{path}: lacks one of the states {list(self.states)} its store records")
        hs = torch.cat([got["aux"]] + [t[:, None] for t in finals], dim=1).to(self.dtype)
        return {"hidden_states": hs, "input_ids": got["input_ids"].to(torch.int32),
                "loss_mask": got["loss_mask"].to(torch.uint8)}

    def sample(self, which: int | str | SampleKey, raw: bool = False) -> dict[str, Any]:
        """One sample by row number (mix order) or by key (`SampleKey` or `dataset/sample_id`); reads only its bytes.
        `raw`: a shard's tensors as stored (8-bit values, scales, channels: `StateCodec.error_bound`), not decoded."""
        from safetensors import safe_open

        i = self._rows[str(which)] if isinstance(which, (str, SampleKey)) else int(which)
        row = self.index.iloc[i]
        a, n = int(row["offset"]), int(row["length"])
        if self.layout != "shards":
            return {**row.to_dict(), **self._read_file(self.dir / row["shard"])}
        with safe_open(str(self.dir / row["shard"]), framework="pt") as f:
            out = {name: f.get_slice(name)[a : a + n]
                   for name in (*self.codec.token_tensors(), "input_ids", "loss_mask")}
            out.update({name: f.get_tensor(name) for name in self.codec.block_tensors()})
        return {**row.to_dict(), **(out if raw else self._decoded(out))}

    def _decoded(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A shard slice's tensors with its states as `hidden_states` [n, S, hidden] (8-bit ones dequantized)."""
        if not self.codec.quantized:
            return tensors
        states = self.codec.decode(tensors, self.dtype)
        return {"hidden_states": states, "input_ids": tensors["input_ids"], "loss_mask": tensors["loss_mask"]}

    def stored_ids(self, which: int) -> tuple[list[int], list[int]]:
        """Input ids and loss mask of one sample as stored, reading only those tensors."""
        if self.layout != "shards":
            return get_trainer(self.layout).read_ids(self.path(which))
        from safetensors import safe_open

        row = self.index.iloc[int(which)]
        a, n = int(row["offset"]), int(row["length"])
        with safe_open(str(self.dir / row["shard"]), framework="pt") as f:
            return f.get_slice("input_ids")[a : a + n].tolist(), f.get_slice("loss_mask")[a : a + n].tolist()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every sample, shard by shard (each shard read once, sequentially)."""
        for rows, part in self.chunks():
            for row in rows:
                a, n = row["at"], int(row["length"])
                yield {**{k: v for k, v in row.items() if k != "at"},
                       **{k: v[a : a + n] for k, v in part.items()}}

    def chunks(self, max_bytes: int = 0) -> Iterator[tuple[list[dict[str, Any]], dict[str, Any]]]:
        """The store in runs of consecutive samples, shard by shard (each shard read once): (their index rows, each
        with `at`, its first token in the run; the run's `hidden_states` [tokens, S, hidden], `input_ids`,
        `loss_mask`). A run holds whole samples up to `max_bytes` stored (one sample at least; 0: the whole shard),
        so a consumer can reduce many samples' states in one call; per-sample layouts give a sample per run."""
        from safetensors.torch import load_file

        cols = list(self.index.columns)
        records = [dict(zip(cols, v)) for v in zip(*(self.index[c].tolist() for c in cols))]  # 3x pandas' to_dict
        if self.layout != "shards":
            for i, row in enumerate(records):
                will_need(*(self.dir / r["shard"] for r in records[i + 1:i + 2]))  # the next file, while this is used
                yield [{**row, "at": 0}], self._read_file(self.dir / row["shard"])
            return
        per_token = max(self.codec.bytes_per_token(int(self.info["hidden_size"])), 1)
        by_shard: dict[str, list[dict[str, Any]]] = {}
        for row in records:
            by_shard.setdefault(row["shard"], []).append(row)
        order = self.files()
        for i, shard in enumerate(order):
            will_need(*(self.dir / f for f in order[i:i + 2]))  # this shard and the next, read ahead by the kernel
            t = load_file(str(self.dir / shard))  # memory-mapped: the bytes are read as the states are used
            block = {k: t[k] for k in self.codec.block_tensors()}
            run: list[dict[str, Any]] = []
            for row in sorted(by_shard[shard], key=lambda r: r["offset"]) + [None]:
                if run and (row is None or row["offset"] != run[-1]["offset"] + run[-1]["length"]
                            or (max_bytes and (row["offset"] + row["length"] - run[0]["offset"]) * per_token > max_bytes)):
                    a, b = int(run[0]["offset"]), int(run[-1]["offset"] + run[-1]["length"])
                    part = {k: v[a:b] for k, v in t.items() if k not in block}
                    yield [{**r, "at": int(r["offset"]) - a} for r in run], self._decoded({**part, **block})
                    run = []
                if row is not None:
                    run.append(row)
            del t


# ---------------------------------------------------------------------------- validation


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
