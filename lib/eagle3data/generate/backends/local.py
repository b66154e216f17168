"""In-process generation with a Hugging Face model: batched, greedy unless params say otherwise.

Output ids are the engine's own ids, cut right after the first stop id (end-of-turn, or the
guard where the profile has one) and never re-tokenized, so records are `ids_exact`. Their
text fields come from `spans.output_texts` (the one split of output ids).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from eagle3data.core.profiles import Profile


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """Ids up to and including the first stop id; True when a stop id was found."""
    stops = set(stop_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return list(ids[: i + 1]), True
    return list(ids), False


class LocalBackend:
    """Batched `model.generate` over left-padded prompts."""

    def __init__(self, model: Any, tokenizer: Any, profile: Profile, sampling: Any, batch_size: int = 8):
        self.model = model
        self.tokenizer = tokenizer
        self.profile = profile
        self.sampling = sampling
        self.batch_size = batch_size
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else profile.end_of_turn.id

    def _generate_kwargs(self) -> dict[str, Any]:
        s = self.sampling
        kw: dict[str, Any] = {
            "max_new_tokens": s.max_new_tokens,
            "eos_token_id": self.profile.stop_ids,
            "pad_token_id": self.pad_id,
        }
        if s.temperature > 0:
            kw.update(do_sample=True, temperature=s.temperature, top_p=s.top_p)
            if s.top_k:
                kw["top_k"] = s.top_k
            if s.min_p:
                kw["min_p"] = s.min_p
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kw

    def generate_batch(self, prompt_ids: list[list[int]]) -> list[dict[str, Any]]:
        """Generate for one batch; returns per prompt `output_ids`, `finish_reason`, timing."""
        import torch

        if self.sampling.temperature > 0:
            torch.manual_seed(self.sampling.seed)
        width = max(len(p) for p in prompt_ids)
        device = next(self.model.parameters()).device
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            input_ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                                      **self._generate_kwargs())
        elapsed = time.perf_counter() - t0
        results = []
        for row in out[:, width:].tolist():
            ids, stopped = cut_at_stop(row, self.profile.stop_ids)
            # after a stop, generate pads the row; without a stop the row is max_new_tokens long
            results.append({"output_ids": ids, "finish_reason": "stop" if stopped else "length",
                            "latency_s": elapsed})
        return results
