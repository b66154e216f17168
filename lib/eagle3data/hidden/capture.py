"""04's forward through transformers (`hidden.backend: hf`): the target loaded for this worker, the profile's
layer plan, the forward hooks that capture the three aux layers and the final state(s) (`Capture`), and the
batches of similar length under a token budget that it runs (`plan_batches`, `pad_batch`, `probe`)."""

from __future__ import annotations

import os
import time
from typing import Any

from eagle3data.core.models import load_model, resolve_model_path, text_config
from eagle3data.core.params import RunParams
from eagle3data.core.profiles import AuxLayers, get_profile
from eagle3data.hidden.store.format import FINAL_NAMES, HiddenError, state_names


def decoder_of(model: Any) -> Any:
    """The decoder stack of a causal LM (holds `.layers` and the final `.norm`)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not hasattr(dec, "layers") or not hasattr(dec, "norm"):
        raise HiddenError(f"{type(model).__name__}: cannot find decoder `.layers` and final `.norm` to hook")
    return dec


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


def worker_device(params: RunParams) -> str:
    """The device of this worker: `cuda` becomes `cuda:<LOCAL_RANK>` under torchrun."""
    dev = params.model.device
    if dev == "cuda" and "LOCAL_RANK" in os.environ and not params.model.device_map:
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return dev


def load_extract_model(params: RunParams) -> Any:
    """The target model for this worker (params' dtype and device_map; device per LOCAL_RANK)."""
    m = params.model
    return load_model(m.path, dtype=m.dtype, device=worker_device(params), device_map=m.device_map,
                      trust_remote_code=m.trust_remote_code)


def load_config(params: RunParams) -> Any:
    """The model's config without loading weights (layer count, hidden size, context)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(resolve_model_path(params.model.path)),
                                      trust_remote_code=params.model.trust_remote_code)


# ---------------------------------------------------------------------------- estimate


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
