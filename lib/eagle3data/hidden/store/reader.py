"""`HiddenReader`: a stored sample by key or row, or the whole store streamed shard by shard, whatever the layout
(shards or a trainer's per-sample files; 8-bit states dequantized).

A file that does not open (truncated by an interrupted copy or a full disk) is a `HiddenError` naming the file and
the samples it holds, never the reader library's own error; `chunks(problems=...)` instead notes it (and, with
`checksums`, a file whose content checksum is not the index's) and goes on with the other files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import orjson

from eagle3data.core.quant import StateCodec
from eagle3data.core.readahead import will_need
from eagle3data.core.reader import SampleKey
from eagle3data.hidden.store.checksum import file_problem
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

    @property
    def checksummed(self) -> bool:
        """Whether 04 recorded a content checksum per file (stores written before checksums have none)."""
        return "checksum" in self.index.columns and bool(self.index["checksum"].notna().all())

    def checksums(self) -> dict[str, str | None]:
        """Each file's content checksum as the index records it (None: not checksummed)."""
        sums = self.index["checksum"].tolist() if "checksum" in self.index.columns else [None] * len(self.index)
        return dict(zip(self.index["shard"].tolist(), sums))

    def file_keys(self, file: str) -> list[str]:
        """The keys of the samples one file holds, in mix order."""
        return [k for k, f in zip(self._rows, self.index["shard"].tolist()) if f == file]

    def unreadable(self, file: str, e: BaseException) -> str:
        """The one line for a file that does not open: its path, the reader's error, the samples it holds."""
        keys = self.file_keys(file)
        msg = (str(e).strip().splitlines() or [""])[0]
        return (f"{self.dir / file}: does not open ({type(e).__name__}: {msg}; truncated or damaged: an interrupted "
                f"copy, a full disk); it holds {len(keys)} sample(s): {', '.join(keys[:5])}{', ...' * (len(keys) > 5)}")

    def file_problem(self, file: str) -> str | None:
        """Why one file cannot be trusted by its content checksum (`checksum.file_problem`), with the samples it holds."""
        why = file_problem(self.dir / file, self.checksums().get(file))
        if why is None:
            return None
        keys = self.file_keys(file)
        return f"{why}; it holds {len(keys)} sample(s): {', '.join(keys[:5])}{', ...' * (len(keys) > 5)}"

    def _read_file(self, path: Path) -> dict[str, Any]:
        """A per-sample file's states in the store's order, `input_ids` int32, `loss_mask` uint8."""
        import torch

        try:
            got = get_trainer(self.layout).read_sample(path)
        except Exception as e:  # noqa: BLE001 - torch / safetensors raise many kinds for a cut file
            raise HiddenError(self.unreadable(path.relative_to(self.dir).as_posix(), e)) from None
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
        try:
            with safe_open(str(self.dir / row["shard"]), framework="pt") as f:
                out = {name: f.get_slice(name)[a : a + n]
                       for name in (*self.codec.token_tensors(), "input_ids", "loss_mask")}
                out.update({name: f.get_tensor(name) for name in self.codec.block_tensors()})
        except Exception as e:  # noqa: BLE001 - SafetensorError and OSError alike: one line naming the file
            raise HiddenError(self.unreadable(row["shard"], e)) from None
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
            try:
                return get_trainer(self.layout).read_ids(self.path(which))
            except Exception as e:  # noqa: BLE001
                raise HiddenError(self.unreadable(self.index.iloc[int(which)]["shard"], e)) from None
        from safetensors import safe_open

        row = self.index.iloc[int(which)]
        a, n = int(row["offset"]), int(row["length"])
        try:
            with safe_open(str(self.dir / row["shard"]), framework="pt") as f:
                return f.get_slice("input_ids")[a : a + n].tolist(), f.get_slice("loss_mask")[a : a + n].tolist()
        except Exception as e:  # noqa: BLE001
            raise HiddenError(self.unreadable(row["shard"], e)) from None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every sample, shard by shard (each shard read once, sequentially)."""
        for rows, part in self.chunks():
            for row in rows:
                a, n = row["at"], int(row["length"])
                yield {**{k: v for k, v in row.items() if k != "at"},
                       **{k: v[a : a + n] for k, v in part.items()}}

    def _checked(self, file: str, problems: dict[str, dict[str, str]] | None, checksums: bool) -> None:
        """With `checksums`, note (or raise, without `problems`) a file whose content checksum is not the index's."""
        why = self.file_problem(file) if checksums else None
        if why is not None:
            if problems is None:
                raise HiddenError(why)
            problems.setdefault(file, {})["checksum"] = why

    def chunks(self, max_bytes: int = 0, *, problems: dict[str, dict[str, str]] | None = None,
               checksums: bool = False, stored: bool = False) -> Iterator[tuple[list[dict[str, Any]], dict[str, Any]]]:
        """The store in runs of consecutive samples, shard by shard (each shard read once): (their index rows, each
        with `at`, its first token in the run; the run's `hidden_states` [tokens, S, hidden], `input_ids`,
        `loss_mask`). A run holds whole samples up to `max_bytes` stored (one sample at least; 0: the whole shard),
        so a consumer can reduce many samples' states in one call; per-sample layouts give a sample per run.
        `stored`: the run also has `stored`, its tensors as the shard stores them (8-bit values, scales, channels:
        `StateCodec.error_bound`); a per-sample file's are its decoded ones.

        `checksums`: each file's content is hashed first (then read from the page cache) and compared with the index.
        A file that does not open (or, with `checksums`, does not match) raises a HiddenError naming it; with
        `problems`, it is noted there instead (`{file: {"readable"|"checksum": the line}}`), the samples of a file
        that does not open are skipped, and the other files are read."""
        from safetensors.torch import load_file

        cols = list(self.index.columns)
        records = [dict(zip(cols, v)) for v in zip(*(self.index[c].tolist() for c in cols))]  # 3x pandas' to_dict
        if self.layout != "shards":
            for i, row in enumerate(records):
                will_need(*(self.dir / r["shard"] for r in records[i + 1:i + 2]))  # the next file, while this is used
                self._checked(row["shard"], problems, checksums)
                try:
                    got = self._read_file(self.dir / row["shard"])
                except HiddenError as e:
                    if problems is None:
                        raise
                    problems[row["shard"]] = {"readable": str(e)}  # cut short: its checksum says no more
                    continue
                yield [{**row, "at": 0}], {**got, "stored": got} if stored else got
            return
        per_token = max(self.codec.bytes_per_token(int(self.info["hidden_size"])), 1)
        by_shard: dict[str, list[dict[str, Any]]] = {}
        for row in records:
            by_shard.setdefault(row["shard"], []).append(row)
        order = self.files()
        for i, shard in enumerate(order):
            will_need(*(self.dir / f for f in order[i:i + 2]))  # this shard and the next, read ahead by the kernel
            self._checked(shard, problems, checksums)
            try:
                t = load_file(str(self.dir / shard))  # memory-mapped: the bytes are read as the states are used
            except Exception as e:  # noqa: BLE001 - SafetensorError ("incomplete metadata") for a cut file
                if problems is None:
                    raise HiddenError(self.unreadable(shard, e)) from None
                problems[shard] = {"readable": self.unreadable(shard, e)}  # cut short: its checksum says no more
                continue
            block = {k: t[k] for k in self.codec.block_tensors()}
            run: list[dict[str, Any]] = []
            for row in sorted(by_shard[shard], key=lambda r: r["offset"]) + [None]:
                if run and (row is None or row["offset"] != run[-1]["offset"] + run[-1]["length"]
                            or (max_bytes and (row["offset"] + row["length"] - run[0]["offset"]) * per_token > max_bytes)):
                    a, b = int(run[0]["offset"]), int(run[-1]["offset"] + run[-1]["length"])
                    part = {k: v[a:b] for k, v in t.items() if k not in block}
                    out = self._decoded({**part, **block})
                    yield [{**r, "at": int(r["offset"]) - a} for r in run], ({**out, "stored": {**part, **block}}
                                                                             if stored else out)
                    run = []
                if row is not None:
                    run.append(row)
            del t


# ---------------------------------------------------------------------------- validation
