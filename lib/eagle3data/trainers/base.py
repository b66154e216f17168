"""What every trainer declares and provides (final state, per-sample file, hand-off files); the hand-off's error."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Callable, Sequence

from eagle3data.core.errors import UserInputError

AUX_STATES = 3  # EAGLE-3 trains on the outputs of three auxiliary decoder layers, then one final state


class HandoffError(UserInputError, RuntimeError):
    """The hand-off cannot be written as asked; the message says why and what to do."""


class Trainer(abc.ABC):
    """One drafter trainer's on-disk contract. Its module subclasses this; `registry` holds one instance.

    Per-sample files hold one sample: `input_ids`, `loss_mask`, the three aux states `aux`
    [n, 3, H] and the final states `finals` ({"pre_norm" | "post_norm": [n, H]}); the final
    state the trainer trains on is always among them, the other one only when 04 stores it.
    """

    name: str
    final_state: str  # the final state it trains on: "pre_norm" or "post_norm"
    sample_suffix: str  # the suffix of its per-sample file (04's `samples/p<position>-<key tag><suffix>`)
    id_mask_bytes: int  # bytes of (input id, loss mask) per token in its per-sample file
    handoff_dir: str  # the folder of its per-sample files in the hand-off
    export_files: tuple[str, ...]  # the token files of 05's export it takes (written by `export.run`)

    def takes(self, final_state: str) -> bool:
        """Whether a store of this `hidden.final_state` holds the final state the trainer trains on."""
        return final_state in (self.final_state, "both")

    def file_bytes_per_token(self, hidden_size: int, dtype: str = "bfloat16") -> int:
        """Bytes one token takes in its per-sample file: 3 aux + its final state, plus id and mask."""
        import torch

        return (AUX_STATES + 1) * hidden_size * getattr(torch, dtype).itemsize + self.id_mask_bytes

    def state_bytes_per_token(self, codec: Any, hidden_size: int) -> int:
        """State bytes per token of its per-sample file when 04 writes it (`hidden.layout` is its name)."""
        return codec.bytes_per_token(hidden_size)

    def handoff_bytes_per_token(self, layout: str, final_state: str, hidden_size: int,
                                dtype: str = "bfloat16") -> int | None:
        """Hidden-state bytes per token the hand-off to this trainer writes on top of 04's store.

        0 when 04 wrote this trainer's own per-sample files (`hidden.layout` is its name: the
        hand-off hardlinks them, on one filesystem); otherwise a full conversion (its file's
        bytes); None when the store lacks the final state it trains on (rerun 04 with that one).
        """
        if not self.takes(final_state):
            return None
        return 0 if layout == self.name else self.file_bytes_per_token(hidden_size, dtype)

    @abc.abstractmethod
    def handoff_name(self, row: int) -> str:
        """The name of row `row`'s per-sample file in the hand-off (under `handoff_dir`)."""

    @abc.abstractmethod
    def write_sample(self, path: Path, input_ids: Any, loss_mask: Any, aux: Any, finals: dict[str, Any],
                     meta: str | None = None, *, tmp_suffix: str = ".tmp", storage: Any = None) -> int:
        """One sample as the trainer's file at `path` (written to a temp name, fsynced, renamed); its size.
        `meta`: 04's `eagle3data` description of the file, stored in it when given. `storage`: an 8-bit
        `core.quant.Storage` the trainer reads natively (None: the states as given)."""

    @abc.abstractmethod
    def read_sample(self, path: Path) -> dict[str, Any]:
        """A per-sample file's `input_ids`, `loss_mask`, `aux` [n, 3, H] and `finals` (the final states it holds)."""

    @abc.abstractmethod
    def read_ids(self, path: Path) -> tuple[list[int], list[int]]:
        """A per-sample file's input ids and loss mask, reading only those tensors."""

    @abc.abstractmethod
    def read_meta(self, path: Path) -> str | None:
        """The `eagle3data` description 04 stored in a per-sample file (None: none stored)."""

    @abc.abstractmethod
    def write_export_vocab(self, out: Path, d2t: Any, t2d: Any, counts: Any) -> dict[str, str]:
        """The draft vocabulary beside 05's token files, as this trainer reads it; file -> what it holds."""

    @abc.abstractmethod
    def write_handoff_files(self, out: Path, samples: Sequence[Any], d2t: Any, t2d: Any, params: Any,
                            model_dir: Callable[[], Path | None]) -> tuple[dict[str, str], dict[str, Any]]:
        """Every hand-off file beside the per-sample files (vocabulary, dataset or config): the files
        (name -> what it holds) and what the hand-off's manifest adds. `model_dir()`: the target's
        folder on this machine (None when only the GPU machine has it), resolved when asked."""
