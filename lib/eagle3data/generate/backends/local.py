"""In-process generation with a Hugging Face model: continuous batching, greedy unless params say otherwise.

Up to `batch_size` rows decode together over one KV cache, left-padded to its longest row. Each prompt
is prefilled alone (batch 1, no padding: the same computation as one `model.generate` per prompt) and
joins the batch; a row leaves the moment it emits a stop id or reaches `max_new_tokens`, and the next
prompt takes its slot, so no slot decodes padding after its row is done and no batch waits for its
longest row. Output ids are the engine's own ids, cut right after the first stop id (end-of-turn, or the
guard where the profile has one) and never re-tokenized, so records are `ids_exact`. Their text fields
come from `spans.output_texts` (the one split of output ids).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from eagle3data.core.profiles import Profile


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """Ids up to and including the first stop id; True when a stop id was found."""
    stops = set(stop_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return list(ids[: i + 1]), True
    return list(ids), False


@dataclass
class _Row:
    """One prompt being generated: the caller's handle, its prompt length, the ids so far."""

    handle: Any
    prompt_len: int
    out: list[int] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` padded with zeros on the left of `dim` (-1 for a mask, -2 for keys/values) to `width`."""
    n = width - t.shape[dim]
    if n == 0:
        return t
    return F.pad(t, (n, 0) if dim == -1 else (0, 0, n, 0))


def _layers(cache: Any) -> list[DynamicLayer]:
    """The cache's layers; only plain dynamic layers can be padded, merged and cut by row."""
    bad = {type(x).__name__ for x in cache.layers if type(x) is not DynamicLayer}
    if bad:
        raise ValueError(f"continuous batching needs a plain DynamicCache; this model's cache has {sorted(bad)}")
    return cache.layers


class _Batch:
    """The rows decoding together: one DynamicCache left-padded to the longest row, and its 2-D mask."""

    def __init__(self) -> None:
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [rows, cache length], 1 = a real position

    def add(self, row: _Row, cache: Any) -> None:
        """Join a prefilled row (its own batch-1 cache) to the batch."""
        n = row.prompt_len
        one = torch.ones(1, n, dtype=torch.long)
        if self.cache is None or self.mask is None:
            self.cache, self.mask = cache, one
        else:
            width = max(self.mask.shape[1], n)
            for mine, theirs in zip(_layers(self.cache), _layers(cache)):
                mine.keys = torch.cat([_left_pad(mine.keys, width, -2), _left_pad(theirs.keys, width, -2)])
                mine.values = torch.cat([_left_pad(mine.values, width, -2), _left_pad(theirs.values, width, -2)])
            self.mask = torch.cat([_left_pad(self.mask, width, -1), _left_pad(one, width, -1)])
        self.rows.append(row)

    def keep(self, idx: list[int]) -> None:
        """Keep only these rows, and drop the leading columns that no kept row uses."""
        if not idx:
            self.rows, self.cache, self.mask = [], None, None
            return
        assert self.mask is not None
        sel = torch.tensor(idx, dtype=torch.long)
        mask = self.mask[sel]
        first = int(mask.any(0).nonzero()[0])
        self.mask = mask[:, first:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys[sel, :, first:]
            layer.values = layer.values[sel, :, first:]
        self.rows = [self.rows[i] for i in idx]


class LocalBackend:
    """Continuous batching over `model.forward` with a KV cache per slot (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, profile: Profile, sampling: Any, batch_size: int = 8):
        self.model = model
        self.tokenizer = tokenizer
        self.profile = profile
        self.sampling = sampling
        self.batch_size = batch_size
        self.stops = set(profile.stop_ids)
        params = inspect.signature(model.forward).parameters  # transformers >= 5.2x calls it `cache`
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.warpers = self._warpers()
        self.batch = _Batch()

    def _warpers(self) -> LogitsProcessorList | None:
        """transformers' own sampling warpers in `generate`'s order; None for greedy."""
        s = self.sampling
        if s.temperature <= 0:
            return None
        w = LogitsProcessorList([TemperatureLogitsWarper(s.temperature)])
        if s.top_k:
            w.append(TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            w.append(TopPLogitsWarper(s.top_p))
        if s.min_p:
            w.append(MinPLogitsWarper(s.min_p))
        return w

    def _next(self, logits: torch.Tensor, last: torch.Tensor) -> list[int]:
        """Next id per row from the last position's logits (argmax, or a draw through the warpers)."""
        if self.warpers is None:
            return logits.argmax(-1).tolist()
        scores = self.warpers(last, logits.float())
        return torch.multinomial(torch.softmax(scores, -1), 1)[:, 0].tolist()

    def _done(self, row: _Row) -> bool:
        return row.out[-1] in self.stops or len(row.out) >= self.sampling.max_new_tokens

    def _result(self, row: _Row) -> dict[str, Any]:
        return {"output_ids": row.out, "finish_reason": "stop" if row.out[-1] in self.stops else "length",
                "latency_s": time.perf_counter() - row.t0}

    def _prefill(self, handle: Any, ids: list[int]) -> _Row:
        """Prefill one prompt alone; its row holds the first output id, its cache joins the batch unless done."""
        row = _Row(handle, len(ids))
        cache = DynamicCache()
        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True, logits_to_keep=1,
                         **{self.cache_kw: cache})  # the last position's logits only, as `generate` asks
        row.out.append(self._next(out.logits[:, -1], torch.tensor([ids[-1:]]))[0])
        if not self._done(row):
            self.batch.add(row, cache)
        return row

    def _decode(self) -> list[_Row]:
        """One decode step of every row in the batch; the rows it finished (they leave the batch)."""
        b = self.batch
        assert b.mask is not None
        last = torch.tensor([[r.out[-1]] for r in b.rows])
        pos = torch.tensor([[r.prompt_len + len(r.out) - 1] for r in b.rows])
        b.mask = torch.cat([b.mask, torch.ones(len(b.rows), 1, dtype=torch.long)], 1)
        out = self.model(input_ids=last.to(self.device), attention_mask=b.mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, **{self.cache_kw: b.cache})
        for r, t in zip(b.rows, self._next(out.logits[:, -1], last)):
            r.out.append(t)
        finished = [r for r in b.rows if self._done(r)]
        if finished:
            b.keep([i for i, r in enumerate(b.rows) if not self._done(r)])
        return finished

    def stream(self, pull: Callable[[], tuple[Any, list[int]] | None]) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Generate until `pull()` (the next `(handle, prompt ids)`, or None for none now) and the batch are
        empty; yields `(handle, result)` as each row finishes: `output_ids`, `finish_reason`, `latency_s`.

        Free slots are filled after the finished rows are yielded, so what the caller does with a result
        (a budget reached, a conversation's next turn) decides what fills the slot. A second pass of an
        interrupted stream starts from an empty batch.
        """
        self.batch = _Batch()
        self.device = next(self.model.parameters()).device
        if self.warpers is not None:
            torch.manual_seed(self.sampling.seed)
        with torch.inference_mode():
            while True:
                finished: list[_Row] = []
                while len(self.batch.rows) < self.batch_size:
                    nxt = pull()
                    if nxt is None:
                        break
                    row = self._prefill(*nxt)
                    if self._done(row):
                        finished.append(row)
                if not finished and not self.batch.rows:
                    return
                if not finished:
                    finished = self._decode()
                for row in finished:
                    yield row.handle, self._result(row)
