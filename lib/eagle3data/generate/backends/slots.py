"""The local backend's KV cache: rows in preallocated buffers, written in place; and a store of prompt prefixes.

`SlotCache` holds up to `slots` rows per layer in one buffer `[slots, kv heads, capacity, head dim]`.
Live rows are the first `n`; every row's tokens end at the shared column `end` (left padding), and the
model sees the window `[start, end)` of the live rows, a view: a decode step writes its one new column
in place instead of concatenating the whole cache (what `DynamicLayer.update` does, a copy of every
layer's cache per step). A row joins by copying its prefill into a free slot; a row leaves by moving the
last live row into its slot; `start` then moves right to the longest live row (the padding no row uses
leaves the window, without a copy); columns entering the window on the left are zeroed, so a
row's padding is zeros, never the tokens of a row that left. When a join needs more room on the left or a step more on the
right, the window is copied once into a new buffer with room on both sides.

`PrefixStore` keeps the prompt caches of the last prompts prefilled, so a prompt that begins with the
same ids (a dataset's system prompt, an agent's long instructions, a conversation's earlier turns)
prefills only the rest.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _Window:
    """What every layer shares: live rows `n`, and the columns `[start, end)` the model sees."""

    def __init__(self) -> None:
        self.n = self.start = self.end = 0


class _SlotLayer(DynamicLayer):
    """One layer's buffers; `keys`/`values` are views of the live rows' window (see the module docstring)."""

    def __init__(self, win: _Window, k: torch.Tensor, v: torch.Tensor):
        super().__init__()
        self.win, self.k, self.v = win, k, v
        self.is_initialized, self.dtype, self.device = True, k.dtype, k.device
        self.view()

    def view(self) -> None:
        w = self.win
        self.keys, self.values = self.k[: w.n, :, w.start : w.end], self.v[: w.n, :, w.start : w.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Write this step's columns right after `end` (in place); the window including them."""
        w, m = self.win, key_states.shape[-2]
        self.k[: w.n, :, w.end : w.end + m] = key_states
        self.v[: w.n, :, w.end : w.end + m] = value_states
        self.keys, self.values = self.k[: w.n, :, w.start : w.end + m], self.v[: w.n, :, w.start : w.end + m]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.win.end - self.win.start


def plain_layers(cache: Any) -> list[DynamicLayer]:
    """A prefill cache's layers; only plain dynamic layers (full attention, no sliding window) can be slotted."""
    bad = {type(x).__name__ for x in cache.layers if type(x) is not DynamicLayer}
    if bad:
        raise ValueError(f"continuous batching needs a plain DynamicCache; this model's cache has {sorted(bad)}")
    return cache.layers


class SlotCache:
    """Up to `slots` rows of KV cache in place (see the module docstring); `cache` is what the model is given."""

    def __init__(self, slots: int, room: int):
        self.slots, self.room = slots, room  # room: columns kept free on the right (a row's decode steps)
        self.win = _Window()
        self.lens: list[int] = []  # cached tokens per live row
        self.cache: Cache | None = None
        self.copies = 0  # window copies into a new buffer (for profiling)

    @property
    def n(self) -> int:
        return self.win.n

    def _layers(self) -> list[_SlotLayer]:
        assert self.cache is not None
        return self.cache.layers  # type: ignore[return-value]

    def _relayout(self, left: int, like: Sequence[DynamicLayer]) -> None:
        """Copy the window into new buffers with `left` columns free before `end` and `room` after it."""
        w = self.win
        width = w.end - w.start
        end = max(left, width) + 32  # a little room for the next, slightly longer prompts (sorted by length)
        cap = end + self.room
        new = []
        for i, src in enumerate(like):
            h, d = src.keys.shape[1], src.keys.shape[-1]
            k = src.keys.new_zeros(self.slots, h, cap, d)  # zeros: padding is masked, and must be finite
            v = src.values.new_zeros(self.slots, src.values.shape[1], cap, src.values.shape[-1])
            if self.cache is not None and w.n:
                old = self._layers()[i]
                k[: w.n, :, end - width : end] = old.k[: w.n, :, w.start : w.end]
                v[: w.n, :, end - width : end] = old.v[: w.n, :, w.start : w.end]
            new.append((k, v))
        w.start, w.end = end - width, end
        self.cache = Cache(layers=[_SlotLayer(w, k, v) for k, v in new])
        self.copies += 1

    def join(self, prefill: Any, length: int) -> None:
        """Add a row from its own batch-1 prefill cache of `length` tokens."""
        layers = plain_layers(prefill)
        w = self.win
        if w.n == 0 and self.cache is not None:
            w.start = w.end  # empty: the window restarts at `end`
        if self.cache is None or w.end - length < 0:
            self._relayout(length, layers)
        start = min(w.start, w.end - length)
        for mine, theirs in zip(self._layers(), layers):
            for buf, src in ((mine.k, theirs.keys), (mine.v, theirs.values)):
                buf[: w.n, :, start : w.start] = 0  # columns entering the window are padding of the rows there
                buf[w.n, :, start : w.end - length] = 0  # and of the new row (a slot may hold a row that left)
                buf[w.n, :, w.end - length : w.end] = src[0]
        w.start = start
        w.n += 1
        self.lens.append(length)
        self._views()

    def leave(self, idx: Sequence[int]) -> list[int]:
        """Drop these rows; returns the new order of the kept rows (old indexes): the last live rows move
        into the freed slots. The window's left edge moves to the longest kept row."""
        w = self.win
        order = list(range(w.n))
        for i in sorted(idx, reverse=True):
            last = len(order) - 1
            if i != last:
                for layer in self._layers():
                    layer.k[i, :, w.start : w.end] = layer.k[last, :, w.start : w.end]
                    layer.v[i, :, w.start : w.end] = layer.v[last, :, w.start : w.end]
                order[i] = order[last]
                self.lens[i] = self.lens[last]
            order.pop()
            self.lens.pop()
            w.n -= 1
        w.start = w.end - max(self.lens) if self.lens else w.end
        self._views()
        return order

    def before_step(self) -> torch.Tensor:
        """Room for one more column; the step's 2-D attention mask (1 = a real position, the new one included)."""
        w = self.win
        if self._layers()[0].k.shape[2] - w.end < 1:
            self._relayout(0, self._layers())
        width = w.end - w.start + 1
        lens = torch.tensor(self.lens) + 1
        return (torch.arange(width)[None, :] >= (width - lens)[:, None]).long()

    def after_step(self) -> None:
        """The step's column is written: every row is one token longer."""
        self.win.end += 1
        self.lens = [n + 1 for n in self.lens]
        self._views()

    def _views(self) -> None:
        if self.cache is not None:
            for layer in self._layers():
                layer.view()


class PrefixStore:
    """The prompt caches of the last `size` prompts prefilled; `longest` finds the longest shared prefix."""

    def __init__(self, size: int = 16, min_len: int = 16):
        self.size, self.min_len = size, min_len
        self.items: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def longest(self, ids: torch.Tensor) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """(shared length, that prompt's per-layer keys/values) for the stored prompt sharing most of `ids`'s
        start, at most all but its last id (the prefill needs one position for the logits); (0, None) when
        no stored prompt shares `min_len` ids."""
        best, kv = 0, None
        for have, layers in self.items:
            m = min(len(have), len(ids) - 1)
            diff = (have[:m] != ids[:m]).nonzero()
            k = int(diff[0]) if len(diff) else m
            if k > best:
                best, kv = k, layers
        return (best, kv) if best >= self.min_len else (0, None)

    def add(self, ids: torch.Tensor, prefill: Any) -> None:
        self.items.append((ids, [(x.keys, x.values) for x in plain_layers(prefill)]))
        del self.items[: -self.size]
