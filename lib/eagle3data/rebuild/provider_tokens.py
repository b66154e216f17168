"""Token-exact ids from a provider's per-token output (OpenAI-style `logprobs`).

An OpenAI-compatible chat completion asked for `logprobs: true` answers, per choice,
`logprobs.content`: one entry per sampled token of the message content, each
`{token, logprob, bytes, top_logprobs}`, where `bytes` is the token's UTF-8 bytes as a list
of integers (null where the provider has none) and `token` its text. OpenRouter passes the
same shape through (`choices[].logprobs.content` / `.refusal`). Neither spec has an entry
for reasoning tokens: reasoning is token-exact only where a provider also returns them
(some engines put the whole raw output, reasoning included, into `logprobs.content`; a
non-standard `logprobs.reasoning` list is taken the same way).

`TokenMapper` maps each entry to the tokenizer's id: its `bytes` where given, else its text's
UTF-8 bytes, spelled in the tokenizer's byte alphabet (GPT-2 `bytes_to_unicode`) and looked
up in the vocabulary; an added token (`</think>`, `<|im_end|>`) is looked up by its text. A
`token_id:N` entry (vLLM `return_tokens_as_token_ids`) is taken as id N. `span_ids` then
proves which spans the ids spell exactly (their bytes joined equal the span's text, and the
tokenizer decodes them to it) and returns the ids of those spans only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

from eagle3data.core.profiles import Profile


def fast_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the object itself)."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


class TokenMapper:
    """Maps provider token entries to the ids of one tokenizer (a ByteLevel BPE: Qwen3, SmolLM2, Kimi)."""

    def __init__(self, tokenizer: Any):
        from tokenizers import decoders

        self.bt = fast_backend(tokenizer)
        try:
            from transformers.convert_slow_tokenizer import bytes_to_unicode
        except ImportError:  # pragma: no cover - moved in some transformers version
            bytes_to_unicode = None
        self.byte_level = bytes_to_unicode is not None and isinstance(self.bt.decoder, decoders.ByteLevel)
        self.char_of = bytes_to_unicode() if self.byte_level else {}
        self.added = {t.content: int(i) for i, t in self.bt.get_added_tokens_decoder().items()}
        self.vocab_size = self.bt.get_vocab_size(with_added_tokens=True)

    def entry_id(self, entry: Any) -> tuple[int, bytes | None] | None:
        """(id, the entry's bytes or None when only an id was given) of one entry, or None when unmappable."""
        if not isinstance(entry, dict):
            return None
        tok, raw_b = entry.get("token"), entry.get("bytes")
        if isinstance(tok, str) and tok.startswith("token_id:"):
            try:
                i = int(tok[len("token_id:"):])
            except ValueError:
                return None
            return (i, None) if 0 <= i < self.vocab_size else None
        raw: bytes | None = None
        if isinstance(raw_b, list) and raw_b and all(isinstance(x, int) and 0 <= x < 256 for x in raw_b):
            raw = bytes(raw_b)
        elif isinstance(tok, str) and tok and "\ufffd" not in tok:  # U+FFFD: the bytes are lost
            raw = tok.encode()
        if raw is None:
            return None
        if isinstance(tok, str) and tok in self.added and raw == tok.encode():
            return self.added[tok], raw
        if not self.byte_level:
            return None
        i = self.bt.token_to_id("".join(map(self.char_of.__getitem__, raw)))
        return (int(i), raw) if i is not None else None

    def ids(self, entries: Sequence[Any]) -> tuple[list[int], list[bytes | None]] | None:
        """Ids and bytes of every entry, or None when any entry does not map."""
        ids: list[int] = []
        raws: list[bytes | None] = []
        for e in entries:
            m = self.entry_id(e)
            if m is None:
                return None
            ids.append(m[0])
            raws.append(m[1])
        return ids, raws


@functools.lru_cache(maxsize=4)
def mapper_for(bt: Any) -> TokenMapper:
    """One mapper per tokenizer (cached)."""
    return TokenMapper(bt)


@dataclass
class ProviderSpans:
    """Which spans the provider's tokens prove, their ids, and what went wrong where they do not."""

    ids: dict[str, list[int]] = field(default_factory=dict)  # span ("reasoning", "content") -> ids
    covered: str | None = None  # what the provider's list covered: "content", "output" (reasoning too), None
    problem: str | None = None  # why the tokens could not be used (None when all is well or none were given)
    reasoning_closed: bool | None = None  # the provider's tokens hold the reasoning-close (whole-output lists only)


def _spells(bt: Any, ids: list[int], raws: list[bytes | None], text: str) -> bool:
    """The ids spell `text`: their bytes joined (where given) decode to it, and the tokenizer decodes them to it."""
    if all(r is not None for r in raws):
        if b"".join(raws).decode("utf-8", "replace") != text:  # type: ignore[arg-type]
            return False
    return bt.decode(ids, skip_special_tokens=False) == text


def span_ids(logprobs: Any, reasoning: str | None, content: str | None, profile: Profile, tokenizer: Any
             ) -> ProviderSpans:
    """The spans of a response that the provider's per-token output spells exactly, with their ids.

    `logprobs` is what the API returned as `choices[0].logprobs`. Its `content` list is taken
    as the content's tokens; failing that, as the whole raw output (reasoning-open,
    reasoning, reasoning-close, content: cut by `profile.split_output`, each span proven
    separately). A trailing stop id (end-of-turn, guard) in the list is dropped: the rebuild
    places it. A `reasoning` list, where a provider returns one, is taken as the reasoning's tokens.
    """
    out = ProviderSpans()
    if not isinstance(logprobs, dict):
        return out
    bt = fast_backend(tokenizer)
    m = mapper_for(bt)
    reasoning, content = reasoning or "", content or ""
    entries = logprobs.get("content")
    if isinstance(entries, list) and entries:
        got = m.ids(entries)
        if got is None:
            out.problem = "a content token does not map to an id of the tokenizer"
        else:
            ids, raws = got
            stops = set(profile.stop_ids)
            while ids and ids[-1] in stops:
                ids, raws = ids[:-1], raws[:-1]
            if content and _spells(bt, ids, raws, content):
                out.ids["content"], out.covered = ids, "content"
            else:
                sp = profile.split_output(ids)
                r_ids = sp.reasoning if sp.reasoning is not None else []
                ok_r = (sp.reasoning is not None and (bool(reasoning) or sp.reasoning_closed)
                        and bt.decode(r_ids, skip_special_tokens=False) == reasoning)
                ok_c = sp.calls is None and bt.decode(sp.content, skip_special_tokens=False) == content
                if ok_r and ok_c:
                    out.covered, out.reasoning_closed = "output", sp.reasoning_closed
                    if reasoning:
                        out.ids["reasoning"] = list(r_ids)
                    if content:
                        out.ids["content"] = list(sp.content)
                else:
                    out.problem = "the content tokens spell neither the content nor the whole output"
    r_entries = logprobs.get("reasoning")
    if isinstance(r_entries, list) and r_entries and "reasoning" not in out.ids and reasoning:
        got = m.ids(r_entries)
        if got is not None and _spells(bt, got[0], got[1], reasoning):
            out.ids["reasoning"] = got[0]
        else:
            out.problem = out.problem or "the reasoning tokens do not spell the reasoning"
    return out
