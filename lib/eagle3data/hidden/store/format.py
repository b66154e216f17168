"""The store's files: their names, the states stored per token and their bytes, a file's own description
(`read_shard_meta`), and the store's errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import orjson

from eagle3data.core.errors import UserInputError
from eagle3data.core.quant import StateCodec
from eagle3data.trainers.base import AUX_STATES
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
