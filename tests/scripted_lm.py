"""A causal-LM stand-in for the local backend: its KV cache holds the token ids themselves.

Each row's reply is `script(prompt ids)`, one id per forward call, whatever the backend does to the
cache between calls (left-pads it, merges rows, cuts finished ones out, starts a prompt from a stored
prompt's cache): the row's prompt and the ids
it has been fed are read back from its own cache row (value 1 = prompt, 2 = generated, 0 = padding).
So a scripted reply comes out right only if the backend keeps every row's cache, mask and order straight.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

VOCAB = 200_000  # above every id of the profiles' vocabularies (Kimi 163,840, Qwen3 151,669)


class ScriptedLM(torch.nn.Module):
    """Replies `script(prompt)` then `pad`; `hook(n)` runs before the n-th prompt's prefill."""

    def __init__(self, script: Callable[[list[int]], list[int]], pad: int, hook: Callable[[int], None] = lambda n: None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # the backend asks for the device
        self.script, self.pad, self.hook = script, pad, hook
        self.calls = 0  # prompts prefilled
        self.prompts: list[list[int]] = []  # in the order they were prefilled
        self.steps: list[int] = []  # rows in each decode step

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kw):
        prefill = attention_mask is None  # a prompt alone (its start may come from a stored prompt's cache)
        assert input_ids.shape[1] >= 1, "every forward feeds an id (the next one comes from its logits)"
        if prefill:
            self.calls += 1
            self.hook(self.calls)
        else:
            self.steps.append(input_ids.shape[0])
            assert attention_mask.shape[1] == cache.get_seq_length() + 1
        ids = input_ids[:, None, :, None].double()  # exact for any id
        cache.update(ids, torch.full_like(ids, 1.0 if prefill else 2.0), 0)
        keys, kinds = cache.layers[0].keys[:, 0, :, 0], cache.layers[0].values[:, 0, :, 0]
        if prefill:
            assert kinds.shape[0] == 1 and bool((kinds == 1).all()), "a prompt's cache holds only prompt ids"
            self.prompts.append(keys[0].long().tolist())
        nxt = []
        for row, kind, mask in zip(keys, kinds, attention_mask if attention_mask is not None else [None] * len(keys)):
            if mask is not None:
                assert torch.equal(mask.bool(), kind > 0), "the mask and the padding disagree"
            reply = self.script(row[kind == 1].long().tolist())
            n = int((kind == 2).sum())
            nxt.append(reply[n] if n < len(reply) else self.pad)
        logits = torch.full((len(nxt), 1, VOCAB), float("-inf"))  # any sampling draws the scripted id
        logits[torch.arange(len(nxt)), 0, torch.tensor(nxt)] = 0.0
        return CausalLMOutputWithPast(logits=logits)
