"""04's store on disk: shards or per-sample trainer files, the index, the reader, and the validation.

What 04 writes (see `hidden.py` for how it is computed): `shards/rRRR-NNNNN.safetensors`
(samples concatenated, self-describing metadata) or, with `hidden.layout` `specforge` /
`speculators`, one file per sample in that trainer's format under `samples/`; then
`index.parquet` + `index.json`, the one index of the mix's samples in mix order.
`HiddenReader` reads a sample by key or row whatever the layout; `validate_store` re-reads
every sample against the run's records (through the one reader).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import orjson

from eagle3data.core.errors import UserInputError
from eagle3data.hidden.mix import Mix, hidden_dir, read_mix, source_sequences
from eagle3data.core.params import RunParams
from eagle3data.core.reader import Sample, SampleKey


class HiddenError(UserInputError, RuntimeError):
    """04 cannot run or cannot trust what it wrote; the message says what to do."""


SHARD_DIR = "shards"
SAMPLE_DIR = "samples"
INDEX_FILE = "index.parquet"
INFO_FILE = "index.json"
AUX_NAMES = ("aux_low", "aux_mid", "aux_high")
FINAL_NAMES = {"pre_norm": ("pre_norm",), "post_norm": ("post_norm",), "both": ("pre_norm", "post_norm")}
SAMPLE_SUFFIX = {"specforge": ".ckpt", "speculators": ".safetensors"}


def state_names(final_state: str = "both") -> tuple[str, ...]:
    """The states stored per token, in order: the three aux layers, then the final state(s)."""
    if final_state not in FINAL_NAMES:
        raise HiddenError(f"unknown final_state {final_state!r}; one of {', '.join(FINAL_NAMES)}")
    return AUX_NAMES + FINAL_NAMES[final_state]


STATE_NAMES = state_names("both")


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


# bytes of (input id, loss mask) per token in each layout: shards int32 + uint8; SpecForge's
# .ckpt int64 + int64 (as its own capture writes them); speculators' token_ids int64 + uint8
ID_MASK_BYTES = {"shards": 4 + 1, "specforge": 8 + 8, "speculators": 8 + 1}


def bytes_per_token(hidden_size: int, dtype: str = "bfloat16", states: int = 4, layout: str = "shards") -> int:
    """Bytes one token takes on disk: states x hidden x dtype size, plus its id and mask (per layout)."""
    return states * hidden_size * _torch_dtype(dtype).itemsize + ID_MASK_BYTES[layout]


def handoff_bytes_per_token(fmt: str, layout: str, final_state: str, hidden_size: int, dtype: str = "bfloat16") -> int | None:
    """Hidden-state bytes per token the 05 hand-off to trainer `fmt` writes on top of 04's store.

    0 when 04 wrote `fmt`'s own per-sample files (the hand-off hardlinks them: same filesystem);
    otherwise a full conversion (4 states per token in the trainer's format); None when the
    store lacks the final state `fmt` needs (rerun 04 with that `final_state`).
    """
    need = {"specforge": "post_norm", "speculators": "pre_norm"}[fmt]
    if need not in FINAL_NAMES[final_state]:
        return None
    return 0 if layout == fmt else bytes_per_token(hidden_size, dtype, 4, fmt)


# ---------------------------------------------------------------------------- shards


def shard_dir(hdir: Path) -> Path:
    return hdir / SHARD_DIR


def sample_dir(hdir: Path) -> Path:
    """Per-sample files of the `specforge` / `speculators` layouts."""
    return hdir / SAMPLE_DIR


@dataclass
class ShardScan:
    """Finished shards found on disk, the samples they hold, and partial shards discarded."""

    shards: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # file (relative to hidden/) -> samples
    discarded: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    kinds: dict[tuple[str, tuple[str, ...]], str] = field(default_factory=dict)  # (layout, states) -> a file

    def check_kind(self, layout: str, states: tuple[str, ...], where: Path) -> None:
        """Refuse a store written with another layout or other states than the params ask for."""
        other = {k: f for k, f in self.kinds.items() if k != (layout, tuple(states))}
        if other:
            (lay, st), f = next(iter(other.items()))
            raise HiddenError(
                f"{where / f}: stored as layout {lay!r} with states {list(st)}, but hidden.layout={layout!r} and "
                f"hidden.final_state ask for {list(states)}: set them as the store was written, or delete {where} "
                "(or point hidden.out_dir elsewhere) to extract again")

    def done_keys(self) -> set[str]:
        return {SampleKey.of(e) for es in self.shards.values() for e in es}


def index_entry(s: Sample, position: int, offset: int) -> dict[str, Any]:
    """A stored sample's index row: its key (and the row it is made from: dataset, sample_id, turn), where it lies."""
    return {"key": str(s.key), "dataset": s.dataset, "sample_id": s.sample_id, "turn": s.turn, "source": s.source,
            "ids_exact": s.ids_exact, "position": position, "offset": offset, "length": len(s.input_ids),
            "loss_tokens": int(sum(s.loss_mask))}


def index_keys(index: Any) -> list[SampleKey]:
    """The key of each row of a hidden-state index frame (in its order)."""
    return SampleKey.of_columns(index["dataset"], index["sample_id"], index["turn"] if "turn" in index else None)


def read_shard_meta(path: Path) -> dict[str, Any]:
    """A shard's (or per-sample file's) own description (samples with offset and length, layers, states, dtype)."""
    path = Path(path)
    if path.suffix == ".ckpt":
        import torch

        raw = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        meta = {"eagle3data": raw["eagle3data"]} if isinstance(raw, dict) and "eagle3data" in raw else {}
    else:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    if "eagle3data" not in meta:
        raise HiddenError(f"{path}: not an eagle3data shard (no `eagle3data` metadata)")
    return orjson.loads(meta["eagle3data"])


def _file_kind(meta: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    # stores written before `hidden.final_state` named the post-norm state `final_norm`
    return meta.get("layout", "shards"), tuple(meta.get("states") or ("aux_low", "aux_mid", "aux_high", "final_norm"))


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

    for d, pattern in ((shard_dir(hdir), "*.safetensors"), (sample_dir(hdir), "p*")):
        if not d.exists():
            continue
        for p in sorted(d.glob("*.tmp")):
            if mine(p):
                p.unlink(missing_ok=True)
                scan.discarded.append(p.name)
        for p in sorted(d.glob(pattern)):
            if p.suffix not in (".safetensors", ".ckpt"):
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
        nums = [int(p.name.split("-")[1].split(".")[0]) for p in self.dir.glob(f"r{rank:03d}-*.safetensors")]
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
        """Queue one sample's states `[n, 4, hidden]` (CPU, storage dtype) with its ids and mask."""
        import torch

        n = len(s.input_ids)
        if states.shape[0] != n:
            raise HiddenError(f"{s.key}: {states.shape[0]} states for {n} tokens")
        nbytes = states.numel() * states.element_size() + 5 * n
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
        name = f"r{self.rank:03d}-{self.next_no:05d}.safetensors"
        tensors = {"hidden_states": torch.cat(self.states).contiguous(), "input_ids": torch.cat(self.ids),
                   "loss_mask": torch.cat(self.masks)}
        meta = {**self.info, "rank": self.rank, "samples": self.entries, "tokens": self.tokens}
        tmp = self.dir / (name + ".tmp")
        save_file(tensors, str(tmp), metadata={"eagle3data": orjson.dumps(meta).decode()})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)
        self.written.append(name)
        self.next_no += 1
        self._reset()
        return name


class SampleFileWriter:
    """Writes each sample at once as one file in a trainer's own format (layout `specforge` / `speculators`).

    `specforge`: `samples/p<position>.ckpt`, a torch file holding `input_ids` and `loss_mask`
    (int64 [n]), `hidden_state` [1, n, H] (post-norm), `aux_hidden_state` [1, n, 3H] and, when
    stored, `pre_norm` [1, n, H]; `speculators`: `samples/p<position>.safetensors` holding
    `hidden_states` [n, 4, H] (3 aux + pre-norm), `token_ids` int64 [n], `loss_mask` uint8 [n]
    and, when stored, `post_norm` [n, H]. Both carry the shard metadata (one sample, offset 0):
    the same key `eagle3data`. Written to `.r<rank>.tmp`, fsynced, renamed.
    """

    def __init__(self, hdir: Path, rank: int, layout: str, info: dict[str, Any]):
        self.dir = sample_dir(hdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.layout = layout
        self.suffix = SAMPLE_SUFFIX[layout]
        self.info = info
        self.names: tuple[str, ...] = tuple(info["states"])
        self.written: list[str] = []
        self.entries: list[dict[str, Any]] = []  # always empty: nothing waits in memory
        self.tokens = 0

    def add(self, s: Sample, position: int, states: Any) -> None:
        import torch

        n = len(s.input_ids)
        if states.shape[0] != n:
            raise HiddenError(f"{s.key}: {states.shape[0]} states for {n} tokens")
        entry = index_entry(s, position, 0)
        meta = orjson.dumps({**self.info, "rank": self.rank, "samples": [entry], "tokens": n}).decode()
        name = f"p{position:09d}{self.suffix}"
        write_sample_file(self.dir / name, self.layout, s.input_ids, s.loss_mask, states, self.names, meta,
                          tmp_suffix=f".r{self.rank:03d}.tmp")
        self.written.append(name)

    def flush(self) -> None:
        return None


def write_sample_file(path: Path, layout: str, input_ids: Any, loss_mask: Any, states: Any, names: tuple[str, ...],
                      meta: str | None = None, *, tmp_suffix: str = ".tmp", keep_extra: bool = True) -> int:
    """One sample in trainer `layout`'s own file format (see SampleFileWriter), written to a temp name,
    fsynced and renamed; `states` [n, S, H] ordered as `names`. `keep_extra` also stores the
    final state the trainer does not read. Returns the file's size."""
    import torch

    n = len(input_ids)
    at = {x: i for i, x in enumerate(names)}
    need = {"specforge": "post_norm", "speculators": "pre_norm"}[layout]
    if need not in at:
        raise HiddenError(f"{path}: the store holds {list(names)}, but {layout} needs the {need} state: "
                          f"rerun 04 with hidden.final_state {need!r} or 'both'")
    aux = states[:, : len(AUX_NAMES)]
    tmp = path.with_name(path.name + tmp_suffix)
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout == "specforge":
        obj: dict[str, Any] = {"input_ids": torch.as_tensor(input_ids, dtype=torch.long).clone(),
                               "loss_mask": torch.as_tensor(loss_mask, dtype=torch.long).clone(),
                               "hidden_state": states[:, at["post_norm"]].contiguous().clone()[None],
                               "aux_hidden_state": aux.reshape(n, -1).contiguous().clone()[None]}
        if keep_extra and "pre_norm" in at:
            obj["pre_norm"] = states[:, at["pre_norm"]].contiguous().clone()[None]
        if meta is not None:
            obj["eagle3data"] = meta
        torch.save(obj, str(tmp))
    else:
        from safetensors.torch import save_file

        i = at["pre_norm"]
        tensors = {"hidden_states": torch.cat([aux, states[:, i : i + 1]], 1).contiguous(),
                   "token_ids": torch.as_tensor(input_ids, dtype=torch.long).clone(),
                   "loss_mask": torch.as_tensor(loss_mask, dtype=torch.uint8).clone()}
        if keep_extra and "post_norm" in at:
            tensors["post_norm"] = states[:, at["post_norm"]].contiguous().clone()
        save_file(tensors, str(tmp), metadata=None if meta is None else {"eagle3data": meta})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def read_sample_file(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """`hidden_states` [n, S, H] in the store's state order, `input_ids` int32, `loss_mask` uint8 of a per-sample file."""
    import torch

    path = Path(path)
    if path.suffix == ".ckpt":
        raw = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        n = raw["input_ids"].shape[-1]
        parts = {"post_norm": raw["hidden_state"][0], "pre_norm": raw["pre_norm"][0] if "pre_norm" in raw else None}
        aux = raw["aux_hidden_state"][0].reshape(n, len(AUX_NAMES), -1)
        ids, mask = raw["input_ids"], raw["loss_mask"]
    else:
        from safetensors.torch import load_file

        raw = load_file(str(path))
        hs = raw["hidden_states"]
        aux = hs[:, : len(AUX_NAMES)]
        parts = {"pre_norm": hs[:, len(AUX_NAMES)], "post_norm": raw.get("post_norm")}
        ids, mask = raw["token_ids"], raw["loss_mask"]
    finals = [parts[x] for x in names[len(AUX_NAMES):]]
    if any(t is None for t in finals):
        raise HiddenError(f"{path}: lacks one of the states {list(names)} its store records")
    hs = torch.cat([aux] + [t[:, None] for t in finals], dim=1)
    return {"hidden_states": hs, "input_ids": ids.to(torch.int32), "loss_mask": mask.to(torch.uint8)}


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
            raise FileNotFoundError(f"no index at {self.dir / INDEX_FILE}: run 04 (or merge_index) first")
        self.index: pd.DataFrame = pd.read_parquet(self.dir / INDEX_FILE)
        self.info: dict[str, Any] = orjson.loads((self.dir / INFO_FILE).read_bytes())
        self._rows = {str(k): i for i, k in enumerate(index_keys(self.index))}
        self.states: tuple[str, ...] = tuple(self.info.get("states") or ("aux_low", "aux_mid", "aux_high", "final_norm"))
        self.layout: str = self.info.get("layout", "shards")

    def path(self, which: int | str) -> Path:
        """The file holding one sample (a shard, or the sample's own file)."""
        i = self._rows[which] if isinstance(which, str) else int(which)
        return self.dir / self.index.iloc[i]["shard"]

    def __len__(self) -> int:
        return len(self.index)

    def keys(self) -> list[str]:
        """`dataset/sample_id` of each stored sample, in mix order."""
        return list(self._rows)

    def sample(self, which: int | str | SampleKey) -> dict[str, Any]:
        """One sample by row number (mix order) or by key (`SampleKey` or `dataset/sample_id`); reads only its bytes."""
        from safetensors import safe_open

        i = self._rows[str(which)] if isinstance(which, (str, SampleKey)) else int(which)
        row = self.index.iloc[i]
        a, n = int(row["offset"]), int(row["length"])
        if self.layout != "shards":
            return {**row.to_dict(), **read_sample_file(self.dir / row["shard"], self.states)}
        with safe_open(str(self.dir / row["shard"]), framework="pt") as f:
            out = {name: f.get_slice(name)[a : a + n] for name in ("hidden_states", "input_ids", "loss_mask")}
        return {**row.to_dict(), **out}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every sample, shard by shard (each shard read once, sequentially)."""
        from safetensors.torch import load_file

        if self.layout != "shards":
            for i in range(len(self.index)):
                yield self.sample(i)
            return
        for shard, rows in self.index.groupby("shard", sort=True):
            t = load_file(str(self.dir / shard))
            for _, row in rows.sort_values("offset").iterrows():
                a, n = int(row["offset"]), int(row["length"])
                yield {**row.to_dict(), **{k: v[a : a + n] for k, v in t.items()}}
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


def validate_store(params: RunParams, *, mix: Mix | None = None) -> Validation:
    """Re-read every sample: shape [n, states, hidden], finite, ids and mask equal to the source records, coverage."""
    import torch

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
        n = int(smp["length"])
        tokens += n
        hs, ids, mask = smp["hidden_states"], smp["input_ids"], smp["loss_mask"]
        want = (n, len(reader.states), hsize)
        if tuple(hs.shape) != want or hs.dtype != dtype:
            bad(smp, "shape", f"{tuple(hs.shape)} {hs.dtype}, expected {want} {dtype}")
        elif not bool(torch.isfinite(hs).all()):
            bad(smp, "finite", f"{int((~torch.isfinite(hs)).sum())} NaN/Inf values")
        if len(ids) != n or len(mask) != n:
            bad(smp, "mask_length", f"{len(ids)} ids, {len(mask)} mask values for {n} states")
        src = sources.get(SampleKey.of(smp))
        if src is None:
            bad(smp, "source", "not found in the run's records / reconstruct files")
        else:
            if ids.tolist() != src.input_ids:
                bad(smp, "ids", "stored input_ids differ from the source record")
            if mask.tolist() != src.loss_mask:
                bad(smp, "mask", "stored loss_mask differs from the source record")
    too_long = len(reader.info.get("too_long", []))
    if seen != len(mix.samples) or reader.keys() != [str(s.key) for s in mix.samples]:
        problems.append({"key": "*", "dataset": "*", "sample_id": "*", "check": "coverage",
                         "detail": f"{seen} stored samples, {len(mix.samples)} in the mix: the index must hold "
                                   "exactly the mix's keys in mix order"})
    return Validation(seen, tokens, problems, len(mix.samples), too_long)


# ---------------------------------------------------------------------------- estimate


@dataclass
class Estimate:
    """What a run will write and how long it will take, checked against the free disk."""

    samples: int
    tokens: int
    hidden_size: int
    bytes_per_token: int
    bytes: int
    free_bytes: int
    margin: float
    probe_tokens: int = 0
    probe_seconds: float = 0.0
    layout: str = "shards"
    final_state: str = "both"
    dtype: str = "bfloat16"
    store_tokens: int | None = None  # tokens of the whole store (done + to do), for the hand-off figures
    turns: dict[str, int] | None = None  # the mix's turn figures (`mix.turn_figures`, the whole mix), or None

    def turn_cost(self) -> dict[str, Any] | None:
        """What per-turn sequences cost in the whole mix (None when it holds no turn records).

        A turn's prompt is the conversation so far, so its sequence starts with (most of) the earlier
        turns' sequences: `repeated_prefix_tokens` are positions stored again, the same states (a
        state depends only on the tokens up to it); `last_turn_*` is what `hidden.train_turns: last`
        would store instead (each conversation's highest turn in the mix).
        """
        t = self.turns
        if not t or not t.get("turn_samples"):
            return None
        return {**t, "repeated_prefix_bytes": t["repeated_prefix_tokens"] * self.bytes_per_token,
                "turn_bytes": t["tokens"] * self.bytes_per_token,
                "last_turn_bytes": t["last_turn_tokens"] * self.bytes_per_token,
                "repeated_share": t["repeated_prefix_tokens"] / t["tokens"] if t["tokens"] else 0.0}

    def handoff(self) -> dict[str, int | None]:
        """Bytes the 05 hand-off to each trainer adds on top of the store (None: the store lacks its final state)."""
        tokens = self.tokens if self.store_tokens is None else self.store_tokens
        out: dict[str, int | None] = {}
        for fmt in ("specforge", "speculators"):
            b = handoff_bytes_per_token(fmt, self.layout, self.final_state, self.hidden_size, self.dtype)
            out[fmt] = None if b is None else b * tokens
        return out

    @property
    def tokens_per_s(self) -> float | None:
        return self.probe_tokens / self.probe_seconds if self.probe_seconds > 0 else None

    @property
    def seconds(self) -> float | None:
        tps = self.tokens_per_s
        return self.tokens / tps if tps else None

    @property
    def fits(self) -> bool:
        return self.free_bytes >= self.bytes * self.margin

    def table(self):
        """The estimate as a one-column table for the notebook."""
        import pandas as pd

        rows = {
            "samples to extract": self.samples,
            "tokens to extract": self.tokens,
            "layout": self.layout,
            "states per token": ", ".join(state_names(self.final_state)),
            "bytes per token (states x hidden x dtype + id + mask)": self.bytes_per_token,
            "estimated size (GB)": round(self.bytes / 1e9, 4),
            "free disk (GB)": round(self.free_bytes / 1e9, 1),
            "fits (with margin)": self.fits,
        }
        for fmt, b in self.handoff().items():
            how = ("impossible: the store lacks its final state" if b is None
                   else "hardlinks 04's files (same filesystem)" if b == 0 else "converts: a full second copy")
            rows[f"05 hand-off to {fmt} (extra GB)"] = None if b is None else round(b / 1e9, 4)
            rows[f"05 hand-off to {fmt}"] = how
        tc = self.turn_cost()
        if tc is not None:
            rows |= {
                "turn records in the mix (conversations)": f"{tc['turn_samples']:,} ({tc['conversations']:,})",
                "turn records: tokens (GB)": f"{tc['tokens']:,} ({tc['turn_bytes'] / 1e9:.4f})",
                "turn prefixes stored again: tokens (GB, share)": (
                    f"{tc['repeated_prefix_tokens']:,} ({tc['repeated_prefix_bytes'] / 1e9:.4f}, "
                    f"{tc['repeated_share']:.1%} of the turn tokens)"),
                "with hidden.train_turns: last: sequences, tokens (GB)": (
                    f"{tc['last_turn_samples']:,}, {tc['last_turn_tokens']:,} ({tc['last_turn_bytes'] / 1e9:.4f})"),
            }
        rows |= {
            "probe tokens/s": None if self.tokens_per_s is None else round(self.tokens_per_s, 1),
            "estimated time (min)": None if self.seconds is None else round(self.seconds / 60, 2),
        }
        return pd.DataFrame({"value": pd.Series(rows, dtype=object)})

    def as_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "tokens": self.tokens, "bytes": self.bytes,
                "bytes_per_token": self.bytes_per_token, "free_bytes": self.free_bytes, "fits": self.fits,
                "probe_tokens_per_s": self.tokens_per_s, "estimated_seconds": self.seconds,
                "layout": self.layout, "states": list(state_names(self.final_state)),
                "handoff_extra_bytes": self.handoff(), "turns": self.turn_cost()}


def check_disk(est: Estimate, where: Path) -> None:
    """Refuse to start when the disk cannot hold the estimated bytes (times the margin)."""
    if not est.fits:
        raise HiddenError(
            f"not enough disk at {where}: 04 needs about {est.bytes / 1e9:.2f} GB "
            f"(x{est.margin} margin = {est.bytes * est.margin / 1e9:.2f} GB) but {est.free_bytes / 1e9:.2f} GB "
            "are free. Free space, point hidden.out_dir at a larger disk, or lower hidden.dataset_caps."
        )


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free
