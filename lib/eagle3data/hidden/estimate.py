"""04's size estimate: the bytes a run will write, the hand-off to each trainer, the free disk and the time."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3data.core.params import RunParams
from eagle3data.core.quant import FORMATS, SCALES, StateCodec, Storage
from eagle3data.hidden.mix import Mix, hidden_dir
from eagle3data.hidden.store.format import HiddenError, bytes_per_token, id_mask_bytes, state_names
from eagle3data.trainers.registry import TRAINERS


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
    storage: str = "bf16"  # the codec's name: `bf16`, or the 8-bit format/scale of aux and final states
    storage_bytes: dict[str, int] | None = None  # bytes per token under each storage choice (`storage_choices`)
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
        for fmt, trainer in TRAINERS.items():
            b = trainer.handoff_bytes_per_token(self.layout, self.final_state, self.hidden_size, self.dtype)
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
            "storage (hidden.storage)": self.storage,
            "bytes per token (states x hidden x dtype, or 8-bit values + scales; + id + mask)": self.bytes_per_token,
            "estimated size (GB)": round(self.bytes / 1e9, 4),
            "free disk (GB)": round(self.free_bytes / 1e9, 1),
            "fits (with margin)": self.fits,
        }
        for name, b in (self.storage_bytes or {}).items():
            rows[f"with storage {name}: bytes per token (GB)"] = f"{b:,} ({b * self.tokens / 1e9:.4f})"
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
                "layout": self.layout, "states": list(state_names(self.final_state)), "storage": self.storage,
                "storage_bytes_per_token": self.storage_bytes,
                "handoff_extra_bytes": self.handoff(), "turns": self.turn_cost()}


def codec_name(codec: StateCodec) -> str:
    """`bf16`, `int8/channel_token`, or `aux int8/token_state, final bf16` when the groups differ."""
    if codec.aux == codec.final:
        return codec.aux.name
    return f"aux {codec.aux.name}, final {codec.final.name}"


def storage_choices(hidden_size: int, states: int, dtype: str = "bfloat16") -> dict[str, int]:
    """Bytes per token (shards: states + id + mask) under each storage a user can choose, for the estimate table."""
    out = {}
    for fmt in FORMATS:
        for scale in (SCALES if fmt != "bf16" else ("token",)):
            st = Storage(fmt, scale)
            out[st.name] = StateCodec(states, st, st, dtype).bytes_per_token(hidden_size) + id_mask_bytes("shards")
    return out


def estimate_work(params: RunParams, work: Any, hidden_size: int, mix: Mix | None = None) -> Estimate:
    """Bytes (tokens x states x hidden x dtype + ids + mask) and free disk of a worker's work left
    (`extract.WorkPlan`; the time comes from `extract.probe`); with the mix, what its turn
    records cost (`Estimate.turn_cost`)."""
    hp = params.hidden
    codec = hp.codec()
    bpt = bytes_per_token(hidden_size, hp.dtype, codec.states, hp.layout, codec)
    tokens = sum(len(s.input_ids) for _, s in work.todo)
    return Estimate(len(work.todo), tokens, hidden_size, bpt, tokens * bpt, _free_bytes(hidden_dir(params)),
                    hp.disk_margin, layout=hp.layout, final_state=hp.final_state, dtype=hp.dtype,
                    storage=codec_name(codec), storage_bytes=storage_choices(hidden_size, codec.states, hp.dtype),
                    store_tokens=sum(len(s.input_ids) for _, s in work.part),
                    turns=None if mix is None else mix.manifest.get("turns"))


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
