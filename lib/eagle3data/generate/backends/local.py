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
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from eagle3data.core.profiles import Profile
from eagle3data.generate.backends.slots import PrefixStore, SlotCache


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """Ids up to and including the first stop id; True when a stop id was found."""
    stops = set(stop_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return list(ids[: i + 1]), True
    return list(ids), False


@dataclass
class _Row:
    """One prompt being generated: the caller's handle, its prompt length, the ids so far, its join order."""

    handle: Any
    prompt_len: int
    seq: int = 0
    out: list[int] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)


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
        self._reset()

    def _reset(self) -> None:
        """An empty batch and prefix store (each stream starts from nothing)."""
        self.rows: list[_Row] = []
        self.slots = SlotCache(self.batch_size, room=self.sampling.max_new_tokens + 1)
        self.prefixes = PrefixStore()
        self.joined = 0
        self.reused = 0  # prompt tokens not prefilled: taken from a stored prefix

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
        """Prefill one prompt alone (batch 1, no padding; a stored prompt's cache for the ids they share);
        its row holds the first output id, its cache joins the batch unless it is done."""
        row = _Row(handle, len(ids), seq=self.joined)
        self.joined += 1
        t = torch.tensor(ids)
        shared, kv = self.prefixes.longest(t)
        cache = DynamicCache()
        for i, (k, v) in enumerate(kv or []):
            cache.update(k[:, :, :shared], v[:, :, :shared], i)
        self.reused += shared
        out = self.model(input_ids=t[None, shared:].to(self.device), use_cache=True, logits_to_keep=1,
                         **{self.cache_kw: cache})  # the last position's logits only, as `generate` asks
        row.out.append(self._next(out.logits[:, -1], t[None, -1:])[0])
        self.prefixes.add(t, cache)
        if not self._done(row):
            self.slots.join(cache, len(ids))
            self.rows.append(row)
        return row

    def _decode(self) -> list[_Row]:
        """One decode step of every row in the batch; the rows it finished (they leave the batch), in the
        order they joined."""
        last = torch.tensor([[r.out[-1]] for r in self.rows])
        pos = torch.tensor([[r.prompt_len + len(r.out) - 1] for r in self.rows])
        mask = self.slots.before_step()
        out = self.model(input_ids=last.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, **{self.cache_kw: self.slots.cache})
        self.slots.after_step()
        for r, t in zip(self.rows, self._next(out.logits[:, -1], last)):
            r.out.append(t)
        done = [i for i, r in enumerate(self.rows) if self._done(r)]
        finished = sorted((self.rows[i] for i in done), key=lambda r: r.seq)
        if done:
            self.rows = [self.rows[i] for i in self.slots.leave(done)]
        return finished

    def stream(self, pull: Callable[[], tuple[Any, list[int]] | None]) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Generate until `pull()` (the next `(handle, prompt ids)`, or None for none now) and the batch are
        empty; yields `(handle, result)` as each row finishes: `output_ids`, `finish_reason`, `latency_s`.

        Free slots are filled after the finished rows are yielded, so what the caller does with a result
        (a budget reached, a conversation's next turn) decides what fills the slot. A second pass of an
        interrupted stream starts from an empty batch.
        """
        self._reset()
        self.device = next(self.model.parameters()).device
        if self.warpers is not None:
            torch.manual_seed(self.sampling.seed)
        with torch.inference_mode():
            while True:
                finished: list[_Row] = []
                while len(self.rows) < self.batch_size:
                    nxt = pull()
                    if nxt is None:
                        break
                    row = self._prefill(*nxt)
                    if self._done(row):
                        finished.append(row)
                if not finished and not self.rows:
                    return
                if not finished:
                    finished = self._decode()
                for row in finished:
                    yield row.handle, self._result(row)
