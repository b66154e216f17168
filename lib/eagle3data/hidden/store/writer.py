"""The store's writers: shards of many samples up to a size cap, or one file per sample in a trainer's own format
(`open_writer` picks by `hidden.layout`); each written to a temporary name, fsynced, renamed, then its content
checksum journaled (`checksum.record_file`, while its bytes are in the page cache)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson

from eagle3data.core.atomic import atomic_path
from eagle3data.core.quant import StateCodec
from eagle3data.core.reader import Sample
from eagle3data.hidden.store.checksum import ids_digest, record_file
from eagle3data.hidden.store.format import (SHARD_ID_MASK_BYTES, SHARD_SUFFIX, HiddenError, sample_dir, shard_dir,
                                           split_states)
from eagle3data.trainers.base import Trainer
from eagle3data.trainers.registry import get_trainer


def index_entry(s: Sample, position: int, offset: int) -> dict[str, Any]:
    """A stored sample's index row: its key (and the row it is made from: dataset, sample_id, turn), where it lies,
    and the digest of its ids (what a resume compares with the mix's: `index.match_stored`)."""
    return {"key": str(s.key), "dataset": s.dataset, "sample_id": s.sample_id, "turn": s.turn, "source": s.source,
            "ids_exact": s.ids_exact, "position": position, "offset": offset, "length": len(s.input_ids),
            "loss_tokens": int(sum(s.loss_mask)), "ids_digest": ids_digest(s.input_ids)}


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
        record_file(self.dir.parent, self.rank, self.dir / name)
        self.written.append(name)
        self.next_no += 1
        self._reset()
        return name


class SampleFileWriter:
    """Writes each sample at once as one file in a trainer's own format (`hidden.layout` a trainer's name).

    `samples/p<position>-<key tag><suffix>` (the tag: 8 hex of the key's hash, so a mix that changed between
    runs never writes one sample's file over another's stored at the same position), written by the trainer's module (`Trainer.write_sample`)
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
        tag = hashlib.blake2b(str(s.key).encode(), digest_size=4).hexdigest()
        name = f"p{position:09d}-{tag}{self.trainer.sample_suffix}"
        aux, finals = split_states(states, self.names)
        self.trainer.write_sample(self.dir / name, s.input_ids, s.loss_mask, aux, finals, meta,
                                  tmp_suffix=f".r{self.rank:03d}.tmp", storage=self.storage)
        record_file(self.dir.parent, self.rank, self.dir / name)
        self.written.append(name)

    def flush(self) -> None:
        return None


def open_writer(hdir: Path, rank: int, layout: str, shard_bytes: int,
                info: dict[str, Any]) -> ShardWriter | SampleFileWriter:
    """The writer of one worker's files in `layout`: shards up to `shard_bytes`, or a trainer's per-sample files."""
    if layout == "shards":
        return ShardWriter(hdir, rank, shard_bytes, info)
    return SampleFileWriter(hdir, rank, layout, info)
