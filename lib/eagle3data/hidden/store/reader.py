"""`HiddenReader`: a stored sample by key or row, or the whole store streamed shard by shard, whatever the layout
(shards or a trainer's per-sample files; 8-bit states dequantized)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import orjson

from eagle3data.core.quant import StateCodec
from eagle3data.core.readahead import will_need
from eagle3data.core.reader import SampleKey
from eagle3data.hidden.store.format import (AUX_NAMES, INDEX_FILE, INFO_FILE, OLD_STATES, HiddenError, HiddenMissing,
                                           _torch_dtype)
from eagle3data.trainers.registry import get_trainer


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
