"""8-bit storage of hidden states: formats, scale schemes, quantize/dequantize and the codec of a stored block.

A storage is a value format (`bf16`, `fp8_e4m3`, `int8`) and, for the 8-bit formats, a scale
scheme over a block of states `[tokens, S, hidden]`:
- `token`: one fp32 scale per token over all S states (what hs-connectors' FP8 connector stores);
- `token_state`: one fp32 scale per token and state;
- `channel_token`: each state's channels are first divided by their absmax over the stored block
  (a shard, or a per-sample file: `channel_stats`, kept beside the values), then one scale per
  token and state. Outlier channels stop setting every other channel's step;
- `channel_rms`: the same with each channel's RMS over the block instead of its absmax, so a
  channel whose absmax one token sets (an attention sink's massive activation) does not give
  every other token a coarse step in it: that token gets the coarse step instead. The RMS is
  taken over rows first divided by their own RMS, so the few tokens whose whole row is large
  (the sink again, in the pre-norm and mid-layer states) do not set the channel profile either:
  on the embedded run this took the pre-norm state's KL from 6.2e-4 to 4.9e-4 (docs/04).
Dequantizing is `values * scales (* channels)`, in fp32, cast to the dtype asked for.
`StateCodec` is how one block of states `[tokens, S, hidden]` becomes named tensors on disk and back:
the aux layers and the final state(s) share one tensor `hidden_states` when they share a storage,
else the final ones go to `final_states`; scales beside them (`<name>_scales`, token-first) and,
for `channel_token`, the block's own channel absmax (`<name>_channels` [states, hidden]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORMATS = ("bf16", "fp8_e4m3", "int8")
SCALES = ("token", "token_state", "channel_token", "channel_rms")
INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn
FP8_MIN_NORMAL = 2.0 ** -6
CHANNEL_FLOOR = 1e-6  # a channel that was all zero in the statistics keeps a unit factor (relative to the largest)


class StorageError(ValueError):
    """A storage spec or a stored block that cannot be read as one."""


@dataclass(frozen=True)
class Storage:
    """One state group's on-disk form: value format and (8-bit only) scale scheme."""

    format: str = "bf16"
    scale: str = "channel_rms"  # "none" for bf16

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise StorageError(f"unknown storage format {self.format!r}; one of {', '.join(FORMATS)}")
        if self.format == "bf16":  # unquantized: no scales, so every bf16 storage is the same one
            object.__setattr__(self, "scale", "none")
        elif self.scale not in SCALES:
            raise StorageError(f"unknown scale scheme {self.scale!r}; one of {', '.join(SCALES)}")

    @property
    def quantized(self) -> bool:
        return self.format != "bf16"

    @property
    def needs_channels(self) -> bool:
        return self.quantized and self.scale in ("channel_token", "channel_rms")

    @property
    def value_bytes(self) -> int:
        return 2 if self.format == "bf16" else 1

    def scale_bytes(self, states: int) -> int:
        """fp32 scale bytes per token for a group of `states` states."""
        if not self.quantized:
            return 0
        return 4 * (1 if self.scale == "token" else states)

    def bytes_per_token(self, states: int, hidden: int) -> int:
        return states * hidden * self.value_bytes + self.scale_bytes(states)

    @property
    def name(self) -> str:
        return self.format if not self.quantized else f"{self.format}/{self.scale}"

    def as_dict(self) -> dict[str, str]:
        return {"format": self.format, "scale": self.scale}

    @classmethod
    def of(cls, spec: Any) -> "Storage":
        """A Storage from its dict form (`as_dict`), a `format/scale` name, or itself."""
        if isinstance(spec, Storage):
            return spec
        if isinstance(spec, dict):
            fmt, scale = spec.get("format", "bf16"), spec.get("scale", "none")
        else:
            fmt, _, scale = str(spec).partition("/")
        if fmt == "bf16":
            return cls("bf16")
        return cls(fmt, scale or "channel_rms")


def _torch() -> Any:
    import torch

    return torch


def channel_stats(states: Any, scale: str = "channel_token") -> Any:
    """Per state and channel absmax (`channel_token`) or RMS of RMS-normalized rows (`channel_rms`) of a block
    `[tokens, S, hidden]`, as fp32 `[S, hidden]`.

    Non-finite values are left out of it: a NaN stays in its own token (and fails that sample's
    validation) instead of spreading through the statistics to every sample of the block."""
    torch = _torch()
    a = states.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    if scale == "channel_token":
        x = a.amax(dim=0)
    else:  # each row over its own RMS first: the profile of a typical token, not of the largest rows
        a = a / a.square().mean(dim=-1, keepdim=True).sqrt().clamp(min=1e-30)
        x = a.square().mean(dim=0).sqrt()
    top = x.amax(dim=1, keepdim=True).clamp(min=1e-30)
    return x.clamp(min=top * CHANNEL_FLOOR)


def quantize(states: Any, storage: Storage, channels: Any = None) -> tuple[Any, Any]:
    """`states` `[tokens, S, hidden]` as (values in the storage's dtype, fp32 scales or None)."""
    torch = _torch()
    if not storage.quantized:
        return states.to(torch.bfloat16), None
    x = states.float()
    if storage.needs_channels:
        if channels is None:
            raise StorageError(f"storage {storage.name} needs the run's channel statistics")
        x = x / channels.to(x.device)
    dims = (1, 2) if storage.scale == "token" else (2,)
    amax = x.abs().amax(dim=dims, keepdim=True)
    top = INT8_MAX if storage.format == "int8" else FP8_MAX
    scales = (amax / top).clamp(min=1e-30)
    y = x / scales
    if storage.format == "int8":
        values = y.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        values = y.to(torch.float8_e4m3fn)
    return values, scales


def dequantize(values: Any, scales: Any, storage: Storage, channels: Any = None, dtype: Any = None) -> Any:
    """The states back from `quantize`'s output, in `dtype` (default bf16)."""
    torch = _torch()
    dtype = dtype or torch.bfloat16
    if not storage.quantized:
        return values.to(dtype)
    if scales is None:
        raise StorageError(f"storage {storage.name}: the block has no scales")
    x = values.float() * scales.float()
    if storage.needs_channels:
        if channels is None:
            raise StorageError(f"storage {storage.name} needs the run's channel statistics")
        x = x * channels.to(x.device).float()
    return x.to(dtype)


def flushed_share(states: Any, storage: Storage, channels: Any = None) -> float:
    """Share of non-zero values that the storage turns into zero or (fp8) a subnormal."""
    torch = _torch()
    x = states.float()
    nonzero = x != 0
    n = int(nonzero.sum())
    if n == 0 or not storage.quantized:
        if storage.quantized or n == 0:
            return 0.0
        return float(((x.to(torch.bfloat16).float() == 0) & nonzero).sum()) / n
    values, scales = quantize(states, storage, channels)
    if storage.format == "int8":
        lost = values == 0
    else:
        lost = values.float().abs() < FP8_MIN_NORMAL
    return float((lost & nonzero).sum()) / n


AUX = 3  # the three aux layers come first in a block; the final state(s) after them


@dataclass(frozen=True)
class StateCodec:
    """The on-disk form of a block of `states` states per token: aux layers in `aux`, final state(s) in `final`."""

    states: int
    aux: Storage = Storage("bf16")
    final: Storage = Storage("bf16")
    dtype: str = "bfloat16"  # the dtype of unquantized groups (hidden.dtype)

    @property
    def groups(self) -> list[tuple[str, int, int, Storage]]:
        """(tensor name, first state, end state, storage) of each stored tensor."""
        if self.aux == self.final:
            return [("hidden_states", 0, self.states, self.aux)]
        return [("hidden_states", 0, AUX, self.aux), ("final_states", AUX, self.states, self.final)]

    @property
    def quantized(self) -> bool:
        return self.aux.quantized or self.final.quantized

    def token_tensors(self) -> list[str]:
        """The names of the stored tensors whose first dimension is the token (sliced per sample)."""
        out = []
        for name, _, _, st in self.groups:
            out.append(name)
            if st.quantized:
                out.append(name + "_scales")
        return out

    def block_tensors(self) -> list[str]:
        """The names of the stored tensors that describe the whole block (channel statistics)."""
        return [name + "_channels" for name, _, _, st in self.groups if st.needs_channels]

    def bytes_per_token(self, hidden: int) -> int:
        """State bytes per token on disk: values in each group's storage plus its scales."""
        total = 0
        for _, a, b, st in self.groups:
            itemsize = _dtype_size(self.dtype) if not st.quantized else 1
            total += (b - a) * hidden * itemsize + st.scale_bytes(b - a)
        return total

    def encode(self, states: Any) -> dict[str, Any]:
        """A block `[tokens, S, hidden]` as its named tensors (channel statistics from this block itself)."""
        torch = _torch()
        if states.shape[1] != self.states:
            raise StorageError(f"a block of {states.shape[1]} states for a codec of {self.states}")
        out: dict[str, Any] = {}
        for name, a, b, st in self.groups:
            part = states[:, a:b]
            if not st.quantized:
                out[name] = part.to(getattr(torch, self.dtype)).contiguous()
                continue
            channels = channel_stats(part, st.scale) if st.needs_channels else None
            values, scales = quantize(part, st, channels)
            out[name], out[name + "_scales"] = values.contiguous(), scales.contiguous()
            if channels is not None:
                out[name + "_channels"] = channels.contiguous()
        return out

    def decode(self, tensors: dict[str, Any], dtype: Any = None) -> Any:
        """The states `[tokens, S, hidden]` back from the tensors `encode` made (token-first ones may be sliced)."""
        torch = _torch()
        parts = []
        for name, _, _, st in self.groups:
            if name not in tensors:
                raise StorageError(f"the block lacks its tensor {name!r}")
            if not st.quantized:
                parts.append(tensors[name] if dtype is None else tensors[name].to(dtype))
                continue
            parts.append(dequantize(tensors[name], tensors.get(name + "_scales"), st, tensors.get(name + "_channels"),
                                    dtype or torch.bfloat16))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _steps(self, tensors: dict[str, Any], name: str, a: int, b: int, st: Storage) -> tuple[Any, Any, Any]:
        """One quantized group's (values as given, per-token scale [tokens, 1 | n, 1], channel statistics [n, hidden] or
        None), from the stored tensors (`encode`'s; token-first ones may be sliced), or from decoded `hidden_states`
        for the schemes without channels (a trainer's FP8 file, read back): there the absmax value was encoded as the
        format's largest value exactly (1% over it for the dtype's rounding), and `values` are decoded, not in steps."""
        torch = _torch()
        values = tensors[name] if name in tensors else tensors["hidden_states"][:, a:b]
        if values.shape[1] != b - a:  # decoded: every group's states in one `hidden_states`
            values = values[:, a:b]
        if values.dtype in (torch.int8, torch.float8_e4m3fn):  # as stored: values in steps
            channels = tensors[name + "_channels"].float() if st.needs_channels else None
            return values, tensors[name + "_scales"].float(), channels
        if st.needs_channels:
            raise StorageError(f"storage {st.name}: its error bound needs the stored scales and channels")
        top = INT8_MAX if st.format == "int8" else FP8_MAX
        amax = values.float().abs().amax(dim=(1, 2) if st.scale == "token" else (2,), keepdim=True)
        return values, amax * (1.01 / top), None

    def error_bound(self, tensors: dict[str, Any]) -> Any:
        """The most each decoded value `[tokens, S, hidden]` can differ from the state that was encoded, fp32: int8
        half a step, fp8 e4m3 half an ulp (2^-4 of the value; 2^-10 of the step below its least normal); 0 for an
        unquantized group (its rounding is the dtype's). From the stored tensors or decoded values (`_steps`)."""
        torch = _torch()
        parts = []
        for name, a, b, st in self.groups:
            if not st.quantized:
                values = tensors[name] if name in tensors else tensors["hidden_states"][:, a:b]
                parts.append(torch.zeros((values.shape[0], b - a, values.shape[-1]), dtype=torch.float32))
                continue
            values, step, channels = self._steps(tensors, name, a, b, st)
            if channels is not None:
                step = step * channels
            stored = values.dtype in (torch.int8, torch.float8_e4m3fn)
            y = values.float().abs() if stored else values.float().abs() / step.clamp(min=1e-30)
            half = 0.5 if st.format == "int8" else 2.0 ** -4 * y + 2.0 ** -10
            parts.append((half * step).expand(values.shape))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def bound_norms(self, tensors: dict[str, Any], norms: Any) -> Any:
        """Each row's 2-norm of `error_bound` [tokens, S], at least, from the scales and channels alone (O(tokens x S)
        where `error_bound` is O(tokens x S x hidden)); `norms` the decoded rows' 2-norms [tokens, S] (fp8's bound is
        relative to the value: ||2^-4 y|| = 2^-4 ||y||)."""
        torch = _torch()
        parts = []
        for name, a, b, st in self.groups:
            if not st.quantized:
                parts.append(torch.zeros(norms.shape[0], b - a))
                continue
            values, scale, channels = self._steps(tensors, name, a, b, st)
            per = channels.norm(dim=-1) if channels is not None else torch.full((b - a,), values.shape[-1] ** 0.5)
            step = (scale[..., 0] * per).expand(norms.shape[0], b - a)  # ||scale x channels|| per row
            parts.append(0.5 * step if st.format == "int8" else 2.0 ** -4 * norms[:, a:b].float() + 2.0 ** -10 * step)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def as_dict(self) -> dict[str, Any]:
        return {"aux": self.aux.as_dict(), "final": self.final.as_dict()}

    @classmethod
    def of_params(cls, final_state: str, storage: str, scale: str, final_storage: str = "same",
                  dtype: str = "bfloat16") -> "StateCodec":
        """The codec of 04's params: 3 aux states + the final state(s) (`both` = 2), each group in its storage."""
        aux = Storage(storage, scale)
        final = aux if final_storage == "same" else Storage(final_storage, scale)
        return cls(3 + (2 if final_state == "both" else 1), aux, final, dtype)

    @classmethod
    def of_info(cls, info: dict[str, Any], states: int) -> "StateCodec":
        """The codec a store's (or file's) description names; stores written before 8-bit storage are plain."""
        spec = info.get("storage") or {}
        return cls(states, Storage.of(spec.get("aux", "bf16")), Storage.of(spec.get("final", "bf16")),
                   info.get("dtype", "bfloat16"))


def _dtype_size(name: str) -> int:
    return int(getattr(_torch(), name).itemsize)


def storage_problem(layout: str, codec: StateCodec) -> str | None:
    """Why 04 cannot store its states this way, or None: int8 with one scale per token over several states (the
    smaller states keep a few of its 255 steps, so verify-hidden fails every sample of such a store), or a trainer's
    per-sample layout that holds only what its trainer reads natively."""
    for _, first, stop, st in codec.groups:
        if st.format == "int8" and st.scale == "token" and stop - first > 1:
            return (f"storage int8 with storage_scale token: one scale per token over {stop - first} states leaves "
                    "the smaller states (aux_low, the post-norm state) a few of int8's steps (top-1 0.57-0.58 on the "
                    "embedded run, docs/04 Store) and verify-hidden fails every sample: use storage_scale "
                    "channel_rms (the default) or token_state")
    if not codec.quantized or layout == "shards":
        return None
    if layout == "speculators" and codec.aux == codec.final and codec.aux.format == "fp8_e4m3" \
            and codec.aux.scale in ("token", "token_state"):
        return None
    return (f"layout {layout!r} holds only what its trainer reads natively: speculators reads fp8_e4m3 with "
            "storage_scale token or token_state for every state (hs-connectors' FP8 files); SpecForge reads bf16. "
            "Use layout 'shards' for other 8-bit storages (05 converts them for the trainer)")
