"""Stage 04: EAGLE-3 hidden states of the training mix, in large bf16 safetensors shards plus an index.

For every token of prompt + output the drafter trains on the states of the target: the
outputs of three decoder layers chosen by the profile's rule (`profiles.aux_layers` on the
model's real layer count) and the final state (`hidden.final_state`): `pre_norm`, the output
of the last decoder layer (speculators applies the verifier's norm itself), `post_norm`, the
final norm's output exactly as the model computes it (SpecForge's target head is a bare
`lm_head`), or `both` (the default). Post-norm is norm(pre-norm) in the model's own compute
dtype; from a stored bf16 pre-norm it can only be recomputed approximately, so a run for
SpecForge stores it. They are captured with forward hooks on those layers, the last layer
and the final norm during a forward of the decoder alone (no LM head, no copy of the other
layers), batched by a token budget over sequences of similar length; padding is computed
but never stored. Which states a store holds is recorded in every file's metadata and in
`index.json` (`states`, `final_state`, `layout`).

On disk (`<run>/hidden/` or `hidden.out_dir`):
- `mix.parquet`, `mix_manifest.json`: the training mix (see `mix.py`).
- `shards/rRRR-NNNNN.safetensors`: `hidden_states` [tokens, 4, hidden] (bf16 by default),
  `input_ids` [tokens] int32, `loss_mask` [tokens] uint8, samples concatenated; the shard's
  metadata lists its samples (offset, length) so shards describe themselves. A shard is
  written to `.tmp` and renamed when complete: a crash leaves at most a `.tmp`, which the
  next run discards and redoes.
- or, with `hidden.layout` `specforge` / `speculators`, one file per sample in that trainer's
  own format under `samples/` (`p<position>.ckpt`: `input_ids`, `loss_mask`, `hidden_state`
  [1, n, H] post-norm, `aux_hidden_state` [1, n, 3H]; `p<position>.safetensors`:
  `hidden_states` [n, 4, H] = 3 aux + pre-norm, `token_ids` [n] int64, `loss_mask`), each with
  the same `eagle3data` metadata. The 05 hand-off (`handoff.py`) hardlinks these files into
  the trainer's folder instead of copying them.
- `index.parquet` (one row per sample: dataset, sample_id, source, ids_exact, position in
  the mix, shard (file), offset, length, loss_tokens) and `index.json` (layers, states, sizes, skipped).

Workers: `RANK`/`WORLD_SIZE` (as `torchrun` sets them) pick a deterministic disjoint part of
the mix (mix position modulo world size); each writes its own shards; the worker that finds
every sample stored merges the one index (`merge_index` does it on demand).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import orjson

from .mix import Mix, build_mix, hidden_dir, read_mix, source_sequences, tmp_tag
from .models import context_limit
from .reader import Sample, SampleKey
from .params import RunParams
from .profiles import AuxLayers, get_profile

class HiddenError(RuntimeError):
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
STAGE = "04_extract_hidden"


# ---------------------------------------------------------------------------- model and capture


def decoder_of(model: Any) -> Any:
    """The decoder stack of a causal LM (holds `.layers` and the final `.norm`)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not hasattr(dec, "layers") or not hasattr(dec, "norm"):
        raise HiddenError(f"{type(model).__name__}: cannot find decoder `.layers` and final `.norm` to hook")
    return dec


def text_config(config: Any) -> Any:
    """The language-model part of a (possibly multimodal) config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_plan(params: RunParams, config: Any) -> AuxLayers:
    """The profile's EAGLE-3 layers for the model's real layer count (from its config)."""
    return get_profile(params.profile).aux_layers(int(text_config(config).num_hidden_layers))


class Capture:
    """Forward hooks on the three auxiliary decoder layers and the final state(s) of a model.

    `run(input_ids, attention_mask)` forwards the decoder alone and returns the states
    `[batch, seq, S, hidden]` in the storage dtype, in the order of `state_names(final_state)`:
    aux low, mid, high, then the last decoder layer's output (`pre_norm`) and/or the final
    norm's output (`post_norm`), each exactly as the model computes it; other layers' outputs
    are never kept. Use as a context manager so the hooks are removed afterwards.
    """

    def __init__(self, model: Any, layers: AuxLayers, store_dtype: Any, final_state: str = "both"):
        self.decoder = decoder_of(model)
        n = len(self.decoder.layers)
        if n != layers.num_layers:
            raise HiddenError(f"model has {n} decoder layers but the layer plan is for {layers.num_layers}")
        self.layers = layers
        self.dtype = store_dtype
        self.names = state_names(final_state)
        finals = {"pre_norm": self.decoder.layers[n - 1], "post_norm": self.decoder.norm}
        mods = [self.decoder.layers[i] for i in layers.layer_outputs] + [finals[x] for x in FINAL_NAMES[final_state]]
        self._n = len(mods)
        self._out: list[Any] = [None] * self._n
        self._handles: list[Any] = []
        for slot, mod in enumerate(mods):
            self._handles.append(mod.register_forward_hook(self._hook(slot)))
        self.input_device = self.decoder.get_input_embeddings().weight.device

    def _hook(self, slot: int):
        def hook(_mod: Any, _inp: Any, out: Any) -> None:
            t = out[0] if isinstance(out, (tuple, list)) else out
            self._out[slot] = t.detach().to(self.dtype)

        return hook

    def run(self, input_ids: Any, attention_mask: Any = None) -> Any:
        import torch

        self._out = [None] * self._n
        with torch.inference_mode():
            self.decoder(input_ids=input_ids.to(self.input_device),
                         attention_mask=None if attention_mask is None else attention_mask.to(self.input_device),
                         use_cache=False)
        if any(t is None for t in self._out):
            raise HiddenError("a capture hook did not fire: the model skipped a hooked module")
        dev = self._out[-1].device
        states = torch.stack([t.to(dev) for t in self._out], dim=2)
        self._out = [None] * self._n
        return states

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


MAX_PAD_SHARE = 0.2  # a batch whose padding would pass this share of its size is closed first


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sequence indices by similar length so that rows x longest <= batch_tokens; longest first.

    Sequences are taken shortest first; a batch is closed when the next one would pass the
    token budget or make padding more than MAX_PAD_SHARE of the batch. A sequence longer than
    the budget goes alone. Longest batches come first so that an out-of-memory shows in the
    first minute, not the last.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in order:
        padded = lengths[i] * (len(cur) + 1)
        if cur and (padded > batch_tokens or 1 - (real + lengths[i]) / padded > MAX_PAD_SHARE):
            batches.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += lengths[i]
    if cur:
        batches.append(cur)
    return batches[::-1]


def pad_batch(seqs: list[list[int]], pad_id: int = 0) -> tuple[Any, Any]:
    """Right-padded `input_ids` and `attention_mask` (None when no row needs padding)."""
    import torch

    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, (None if bool(mask.all()) else mask)


# ---------------------------------------------------------------------------- environment


def dist_env() -> tuple[int, int]:
    """(rank, world_size) from the torch.distributed environment (`torchrun` sets RANK/WORLD_SIZE)."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise HiddenError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                          "must be integers") from None
    if world < 1 or not 0 <= rank < world:
        raise HiddenError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    return rank, world


def worker_device(params: RunParams) -> str:
    """The device of this worker: `cuda` becomes `cuda:<LOCAL_RANK>` under torchrun."""
    dev = params.model.device
    if dev == "cuda" and "LOCAL_RANK" in os.environ and not params.model.device_map:
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return dev


def load_extract_model(params: RunParams) -> Any:
    """The target model for this worker (params' dtype and device_map; device per LOCAL_RANK)."""
    from .models import load_model

    m = params.model
    return load_model(m.path, dtype=m.dtype, device=worker_device(params), device_map=m.device_map,
                      trust_remote_code=m.trust_remote_code)


def load_config(params: RunParams) -> Any:
    """The model's config without loading weights (layer count, hidden size, context)."""
    from transformers import AutoConfig

    from .models import resolve_model_path

    return AutoConfig.from_pretrained(str(resolve_model_path(params.model.path)),
                                      trust_remote_code=params.model.trust_remote_code)


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
        return {SampleKey(str(e["dataset"]), str(e["sample_id"])) for es in self.shards.values() for e in es}


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
        self.entries.append({"dataset": s.dataset, "sample_id": s.sample_id, "source": s.source,
                             "ids_exact": s.ids_exact, "position": position, "offset": self.tokens, "length": n,
                             "loss_tokens": int(sum(s.loss_mask))})
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
        entry = {"dataset": s.dataset, "sample_id": s.sample_id, "source": s.source, "ids_exact": s.ids_exact,
                 "position": position, "offset": 0, "length": n, "loss_tokens": int(sum(s.loss_mask))}
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
                "handoff_extra_bytes": self.handoff()}


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


def probe(capture: Capture, seqs: list[list[int]], batches: list[list[int]], k: int) -> tuple[int, float]:
    """Time `k` batches spread over the plan (nothing stored); return (tokens, seconds)."""
    if k <= 0 or not batches:
        return 0, 0.0
    picks = sorted({round(j * (len(batches) - 1) / max(k - 1, 1)) for j in range(min(k, len(batches)))})
    capture.run(*pad_batch([seqs[i] for i in batches[picks[-1]]][:1]))  # warm-up, not timed
    toks, secs = 0, 0.0
    for b in picks:
        ids, mask = pad_batch([seqs[i] for i in batches[b]])
        t0 = time.perf_counter()
        capture.run(ids, mask)
        _sync()
        secs += time.perf_counter() - t0
        toks += sum(len(seqs[i]) for i in batches[b])
    return toks, secs


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- run


@dataclass
class WorkPlan:
    """This worker's share of the mix: samples still to extract, and those too long for the model."""

    rank: int
    world_size: int
    part: list[tuple[int, Sample]]
    todo: list[tuple[int, Sample]]
    too_long: list[dict[str, Any]]
    max_context: int
    scan: ShardScan


def plan_work(params: RunParams, mix: Mix, config: Any, *, rank: int, world_size: int,
              discard_partial: bool = True) -> WorkPlan:
    """Split the mix for this rank and leave out samples already in finished shards.

    Too-long sequences never reach here: the mix drops them (`too_long`, reported with the plan).
    """
    hdir = hidden_dir(params)
    max_ctx = context_limit(params, config) or 0
    part = [(i, s) for i, s in enumerate(mix.samples) if i % world_size == rank]
    too_long = [d for d in mix.dropped if d["reason"] == "too_long"]
    scan = scan_shards(hdir, discard_for_rank=rank if discard_partial else None,
                       discard_all=discard_partial and world_size == 1)
    scan.check_kind(params.hidden.layout, state_names(params.hidden.final_state), hdir)
    done = scan.done_keys()
    todo = [(i, s) for i, s in part if s.key not in done]
    return WorkPlan(rank, world_size, part, todo, too_long, max_ctx, scan)


def estimate_extract(params: RunParams, plan: WorkPlan, config: Any, capture: Capture | None = None) -> Estimate:
    """Bytes (tokens x 4 x hidden x dtype + ids + mask) and, with a capture, time from a short probe."""
    hp = params.hidden
    hsize = int(text_config(config).hidden_size)
    bpt = bytes_per_token(hsize, hp.dtype, len(state_names(hp.final_state)), hp.layout)
    tokens = sum(len(s.input_ids) for _, s in plan.todo)
    hdir = hidden_dir(params)
    est = Estimate(len(plan.todo), tokens, hsize, bpt, tokens * bpt, _free_bytes(hdir), hp.disk_margin,
                   layout=hp.layout, final_state=hp.final_state, dtype=hp.dtype,
                   store_tokens=sum(len(s.input_ids) for _, s in plan.part))
    if capture is not None and plan.todo:
        seqs = [s.input_ids for _, s in plan.todo]
        batches = plan_batches([len(x) for x in seqs], params.hidden.batch_tokens)
        est.probe_tokens, est.probe_seconds = probe(capture, seqs, batches, params.hidden.probe_batches)
    return est


def estimate(params: RunParams, *, model: Any = None) -> Estimate:
    """Size of what this worker still has to extract, the free disk, and (given a model) a timed probe.

    Reads nothing but headers and deletes nothing: safe to call before `run_extract`.
    """
    rank, world = dist_env()
    config = model.config if model is not None else load_config(params)
    mix = build_mix(params, max_context=context_limit(params, config))
    plan = plan_work(params, mix, config, rank=rank, world_size=world, discard_partial=False)
    if model is None:
        return estimate_extract(params, plan, config)
    with Capture(model, layer_plan(params, config), _torch_dtype(params.hidden.dtype), params.hidden.final_state) as cap:
        return estimate_extract(params, plan, config, cap)


@dataclass
class ExtractResult:
    """What one worker did, and (when it merged) the index and the validation of the whole store."""

    hidden_dir: Path
    rank: int
    world_size: int
    mix_manifest: dict[str, Any]
    estimate: Estimate | None
    stats: dict[str, Any]
    too_long: list[dict[str, Any]]
    merged: bool
    index: Any = None
    validation: "Validation | None" = None
    waiting_for: int = 0

    def table(self):
        """Per dataset (from the merged index): samples, tokens, trained tokens and bytes stored."""
        import pandas as pd

        if self.index is None or not len(self.index):
            return pd.DataFrame(columns=["samples", "tokens", "loss_tokens", "bytes"])
        bpt = bytes_per_token(self.stats["hidden_size"], self.stats["dtype"], len(self.stats["states"]),
                              self.stats["layout"])
        g = self.index.groupby("dataset").agg(samples=("sample_id", "size"), tokens=("length", "sum"),
                                              loss_tokens=("loss_tokens", "sum"))
        g["bytes"] = g["tokens"] * bpt
        return g

    def stats_table(self):
        """This worker's throughput, padding and resume counts."""
        import pandas as pd

        return pd.DataFrame({"value": pd.Series(self.stats, dtype=object)})

    def too_long_table(self):
        """Sequences skipped because they exceed the model's context (never truncated)."""
        import pandas as pd

        return pd.DataFrame(self.too_long, columns=["dataset", "sample_id", "tokens", "max_context"])

    def figures(self) -> dict[str, Any]:
        """Key numbers for the notebook's `figures` cell."""
        v = self.validation
        return {
            "samples": int(len(self.index)) if self.index is not None else None,
            "tokens": int(self.index["length"].sum()) if self.index is not None else None,
            "too_long": len(self.too_long),
            "pad_fraction": self.stats.get("pad_fraction"),
            "tokens_per_s": self.stats.get("tokens_per_s"),
            "estimated_bytes": self.estimate.bytes if self.estimate else None,
            "validation_problems": None if v is None else len(v.problems),
            "merged": self.merged,
        }


def run_extract(params: RunParams, progress: bool = True, *, model: Any = None, mix: Mix | None = None,
                max_new_shards: int | None = None) -> ExtractResult:
    """Stage 04 for this worker: mix, plan, estimate (refuse if the disk is short), extract, merge, validate.

    `max_new_shards` stops after writing that many shards (to bound a session; resume later).
    """
    from tqdm.auto import tqdm

    from .provenance import write_provenance

    hp = params.hidden
    hdir = hidden_dir(params)
    rank, world = dist_env()
    config = model.config if model is not None else load_config(params)
    mix = mix or build_mix(params, max_context=context_limit(params, config))
    layers = layer_plan(params, config)
    plan = plan_work(params, mix, config, rank=rank, world_size=world)
    if rank == 0:
        write_provenance(params.run_dir, STAGE, params)

    stats: dict[str, Any] = {
        "rank": rank, "world_size": world, "samples_in_part": len(plan.part),
        "already_stored": len(plan.part) - len(plan.todo),
        "to_extract": len(plan.todo), "too_long": len(plan.too_long),
        "partial_shards_discarded": len(plan.scan.discarded), "hidden_size": int(text_config(config).hidden_size),
        "dtype": hp.dtype, "layers_hf_indices": list(layers.hf_indices),
        "layers_outputs": list(layers.layer_outputs), "num_layers": layers.num_layers,
        "states": list(state_names(hp.final_state)), "layout": hp.layout,
        "extracted": 0, "tokens": 0, "computed_tokens": 0, "padded_tokens": 0, "batches": 0, "shards_written": 0,
        "seconds": 0.0, "tokens_per_s": None, "pad_fraction": None, "stopped_early": False,
    }
    est = estimate_extract(params, plan, config)
    check_disk(est, hdir)
    if plan.todo:
        model = model if model is not None else load_extract_model(params)
        info = {"model": params.model.name, "profile": params.profile, "hidden_size": stats["hidden_size"],
                "dtype": hp.dtype, "num_layers": layers.num_layers, "hf_indices": list(layers.hf_indices),
                "layer_outputs": list(layers.layer_outputs), "states": list(state_names(hp.final_state)),
                "final_state": hp.final_state, "layout": hp.layout, "mix_fingerprint": mix.manifest.get("fingerprint")}
        with Capture(model, layers, _torch_dtype(hp.dtype), hp.final_state) as cap:
            seqs = [s.input_ids for _, s in plan.todo]
            batches = plan_batches([len(x) for x in seqs], hp.batch_tokens)
            est.probe_tokens, est.probe_seconds = probe(cap, seqs, batches, hp.probe_batches)
            writer = (ShardWriter(hdir, rank, hp.shard_bytes, info) if hp.layout == "shards"
                      else SampleFileWriter(hdir, rank, hp.layout, info))
            pad_id = int(getattr(text_config(config), "pad_token_id", None) or 0)
            bar = tqdm(total=sum(len(x) for x in seqs), desc=f"extract r{rank}", unit="tok", disable=not progress)
            t0 = time.perf_counter()
            try:
                for b in batches:
                    ids, mask = pad_batch([seqs[i] for i in b], pad_id)
                    states = cap.run(ids, mask).cpu()
                    stats["batches"] += 1
                    stats["padded_tokens"] += ids.numel()
                    stats["computed_tokens"] += sum(len(seqs[i]) for i in b)
                    for r, i in enumerate(b):
                        pos, s = plan.todo[i]
                        writer.add(s, pos, states[r, : len(s.input_ids)].clone())
                        stats["extracted"] += 1
                        stats["tokens"] += len(s.input_ids)
                        if max_new_shards is not None and len(writer.written) >= max_new_shards:
                            stats["stopped_early"] = True
                            break
                    del states
                    bar.update(sum(len(seqs[i]) for i in b))
                    if not stats["stopped_early"] and (params.run_dir / "STOP").exists():
                        writer.flush()  # graceful stop (Ctrl-C on `eagle3data run`, `eagle3data stop`): the shard in progress is written
                        stats["stopped_early"] = True
                        stats["stop_reason"] = "STOP file"
                    if stats["stopped_early"]:
                        break
                if not stats["stopped_early"]:
                    writer.flush()
            finally:
                bar.close()
            _sync()
            stats["seconds"] = round(time.perf_counter() - t0, 3)
            stats["shards_written"] = len(writer.written)
            # samples still queued when stopping early are not stored: count what is on disk
            stats["extracted"] -= len(writer.entries)
            stats["tokens"] -= writer.tokens
    if stats["padded_tokens"]:
        stats["pad_fraction"] = round(1 - stats["computed_tokens"] / stats["padded_tokens"], 4)
    if stats["seconds"]:
        stats["tokens_per_s"] = round(stats["computed_tokens"] / stats["seconds"], 1)

    result = ExtractResult(hdir, rank, world, mix.manifest, est, stats, plan.too_long, merged=False)
    if stats["stopped_early"]:
        return result
    try:
        index = merge_index(params, mix=mix, config=config)
    except IncompleteError as e:
        result.waiting_for = e.missing
        return result
    result.merged = True
    result.index = index
    if hp.validate_after:
        result.validation = validate_store(params, mix=mix)
    return result


# ---------------------------------------------------------------------------- merge and index


class IncompleteError(HiddenError):
    """Some samples of the mix are not stored yet (other workers still running, or a stopped run)."""

    def __init__(self, msg: str, missing: int):
        super().__init__(msg)
        self.missing = missing


def merge_index(params: RunParams, *, mix: Mix | None = None, config: Any = None,
                allow_partial: bool = False) -> Any:
    """Build the one `index.parquet` (+ `index.json`) from every worker's finished shards.

    Each mix sample appears once (a sample found in two shards, e.g. after the world size
    changed mid-run, is indexed from the first shard by name and counted as a duplicate);
    shard samples no longer in the mix are left out and counted as stale. Raises
    IncompleteError while samples are missing, unless `allow_partial`.
    """
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    hdir = hidden_dir(params)
    mix = mix or read_mix(hdir)
    config = config if config is not None else load_config(params)
    layers = layer_plan(params, config)
    want = {s.key: (i, s) for i, s in enumerate(mix.samples)}
    too_long = [d for d in mix.dropped if d["reason"] == "too_long"]  # reported here too; never in the mix
    scan = scan_shards(hdir)
    states = state_names(params.hidden.final_state)
    scan.check_kind(params.hidden.layout, states, hdir)
    rows: dict[str, dict[str, Any]] = {}
    duplicates = stale = 0
    for shard, entries in sorted(scan.shards.items()):
        for e in entries:
            k = SampleKey(str(e["dataset"]), str(e["sample_id"]))
            if k not in want:
                stale += 1
                continue
            if k in rows:
                duplicates += 1
                continue
            rows[k] = {**e, "position": want[k][0], "shard": shard}
    missing = [str(k) for k in want if k not in rows]
    if missing and not allow_partial:
        raise IncompleteError(f"{len(missing)} of {len(want)} mix samples are not stored yet "
                              f"(e.g. {missing[:3]}): other workers still running, or resume this one", len(missing))
    cols = ["dataset", "sample_id", "source", "ids_exact", "position", "shard", "offset", "length", "loss_tokens"]
    df = pd.DataFrame(sorted(rows.values(), key=lambda r: r["position"]), columns=cols)
    df = df.astype({"position": "int64", "offset": "int64", "length": "int64", "loss_tokens": "int64"})
    tag = tmp_tag()
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), str(hdir / INDEX_FILE) + tag)
    os.replace(str(hdir / INDEX_FILE) + tag, hdir / INDEX_FILE)
    hsize = int(text_config(config).hidden_size)
    info = {
        "model": params.model.name, "profile": params.profile, "num_layers": layers.num_layers,
        "hf_indices": list(layers.hf_indices), "layer_outputs": list(layers.layer_outputs),
        "states": list(states), "final_state": params.hidden.final_state, "layout": params.hidden.layout,
        "hidden_size": hsize, "dtype": params.hidden.dtype,
        "samples": int(len(df)), "tokens": int(df["length"].sum()), "loss_tokens": int(df["loss_tokens"].sum()),
        "bytes_per_token": bytes_per_token(hsize, params.hidden.dtype, len(states), params.hidden.layout),
        "shards": sorted(scan.shards), "shard_file_bytes": sum((hdir / s).stat().st_size for s in scan.shards),
        "too_long": too_long, "missing": len(missing), "duplicates_not_indexed": duplicates,
        "stale_not_indexed": stale, "mix_fingerprint": mix.manifest.get("fingerprint"),
    }
    (hdir / (INFO_FILE + tag)).write_bytes(orjson.dumps(info, option=orjson.OPT_INDENT_2))
    os.replace(hdir / (INFO_FILE + tag), hdir / INFO_FILE)
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
            raise FileNotFoundError(f"no index at {self.dir / INDEX_FILE}: run 04 (or merge_index) first")
        self.index: pd.DataFrame = pd.read_parquet(self.dir / INDEX_FILE)
        self.info: dict[str, Any] = orjson.loads((self.dir / INFO_FILE).read_bytes())
        self._rows = {str(SampleKey(str(d), str(s))): i
                      for i, (d, s) in enumerate(zip(self.index["dataset"], self.index["sample_id"]))}
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
        problems.append({"dataset": row["dataset"], "sample_id": row["sample_id"], "check": check, "detail": detail})

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
        src = sources.get(SampleKey(str(smp["dataset"]), str(smp["sample_id"])))
        if src is None:
            bad(smp, "source", "not found in the run's records / reconstruct files")
        else:
            if ids.tolist() != src.input_ids:
                bad(smp, "ids", "stored input_ids differ from the source record")
            if mask.tolist() != src.loss_mask:
                bad(smp, "mask", "stored loss_mask differs from the source record")
    too_long = len(reader.info.get("too_long", []))
    if seen != len(mix.samples) or reader.keys() != [str(s.key) for s in mix.samples]:
        problems.append({"dataset": "*", "sample_id": "*", "check": "coverage",
                         "detail": f"{seen} stored samples, {len(mix.samples)} in the mix: the index must hold "
                                   "exactly the mix's keys in mix order"})
    return Validation(seen, tokens, problems, len(mix.samples), too_long)


# ---------------------------------------------------------------------------- CLI (torchrun)


def main(argv: list[str] | None = None) -> int:
    """`[torchrun --nproc-per-node N] python -m eagle3data.hidden PARAMS [-p KEY VALUE]... [--merge-only]`."""
    import argparse

    from .params import ParamsError, load_params

    ap = argparse.ArgumentParser(prog="python -m eagle3data.hidden", description=main.__doc__)
    ap.add_argument("params")
    ap.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override a param")
    ap.add_argument("--merge-only", action="store_true", help="only merge the index and validate")
    args = ap.parse_args(argv)
    try:
        params = load_params(args.params, dict(args.p or []))
    except ParamsError as e:
        print(e)
        return 2
    if args.merge_only:
        df = merge_index(params)
        v = validate_store(params)
        print(f"index: {len(df)} samples, {int(df['length'].sum())} tokens; validation problems: {len(v.problems)}")
        return 0 if v.ok else 1
    res = run_extract(params, progress=dist_env()[0] == 0)
    print(orjson.dumps({"rank": res.rank, **res.stats}).decode())
    if res.merged:
        print(f"index merged: {len(res.index)} samples; validation problems: "
              f"{'skipped' if res.validation is None else len(res.validation.problems)}")
        return 0 if res.validation is None or res.validation.ok else 1
    print(f"rank {res.rank}: done; {res.waiting_for} samples of other workers not stored yet "
          "(the last worker to finish merges the index)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
