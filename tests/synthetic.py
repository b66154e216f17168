"""Synthetic Kimi-K2.5-profile records, for tests and benchmarks without the Kimi tokenizer.

`SyntheticTokenizer` is a small deterministic tokenizer on the kimi-k2.5 profile's ids: the
profile's special tokens and Kimi's role tokens at their real ids, printable ASCII
characters, and every lowercase word of 1-3 letters with a leading space. It encodes by
greedy longest match, so `encode(decode(ids)) == ids` for ids it produced, and a word
split in two ("merge across a seam") decodes to the same text but re-encodes differently.
It renders a Kimi-style chat template (tool declarations in a leading system turn, the real
template's history rule for reasoning and tool turns, generation prompt ending in `<think>`).

Test-only code: it lives with the tests and registers the tokenizer source `synthetic:PROFILE`
with `eagle3data.core.models.register_tokenizer` when imported (the tests' conftest imports it and
names this file in EAGLE3DATA_PLUGINS, so notebook kernels started by the tests load it too).

`synthetic_records` builds valid reasoning records (200-8,000 output tokens by default,
some with a tool-call section); `synthetic_id_table` builds the flat arrays directly for
throughput measurements.
"""

from __future__ import annotations

import itertools
import json
import string
from typing import Any, Sequence

import numpy as np

from eagle3data.core.profiles import KIMI_K25, Profile

KIMI_ROLE_TOKENS = {
    163584: "[BOS]", 163587: "<|im_user|>", 163588: "<|im_assistant|>", 163594: "<|im_system|>",
    163601: "<|im_middle|>", 163838: "[UNK]", 163839: "[PAD]",
}
_ASCII = [chr(c) for c in range(32, 127)] + ["\n"]
_WORDS = [" " + "".join(w) for n in (1, 2, 3) for w in itertools.product(string.ascii_lowercase, repeat=n)]


class SyntheticTokenizer:
    """Deterministic tokenizer on kimi-k2.5 ids (see module docstring); no files needed."""

    name_or_path = "synthetic-kimi"

    def __init__(self, profile: Profile = KIMI_K25):
        self.profile = profile
        self.vocab_size = profile.vocab_size
        self.pieces: list[str] = _ASCII + _WORDS
        self.special: dict[int, str] = dict(KIMI_ROLE_TOKENS)
        for t in profile.special_tokens():
            self.special[t.id] = t.text
        self.piece_id = {p: i for i, p in enumerate(self.pieces)}
        self.special_id = {v: k for k, v in self.special.items()}
        self.word_ids = np.arange(len(_ASCII), len(self.pieces), dtype=np.int64)
        self.table = np.array(self.pieces + [""], dtype=object)  # last slot: ids that decode to nothing
        self.pad_token_id = 163839

    def __len__(self) -> int:
        return self.vocab_size

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        if isinstance(ids, (int, np.integer)):
            i = int(ids)
            return self.special.get(i) or (self.pieces[i] if 0 <= i < len(self.pieces) else None)
        return [self.convert_ids_to_tokens(i) for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in self.special:
                if not skip_special_tokens:
                    out.append(self.special[i])
            elif 0 <= i < len(self.pieces):
                out.append(self.pieces[i])
        return "".join(out)

    def decode_words(self, ids: np.ndarray) -> str:
        """Fast decode of ids known to be ordinary pieces (no special ids)."""
        return "".join(self.table[np.where((ids >= 0) & (ids < len(self.pieces)), ids, len(self.pieces))])

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(x, skip_special_tokens=skip_special_tokens) for x in batch]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        i, n = 0, len(text)
        specials = sorted(self.special_id, key=len, reverse=True)
        while i < n:
            if text[i] in "<[":
                hit = next((s for s in specials if text.startswith(s, i)), None)
                if hit:
                    out.append(self.special_id[hit])
                    i += len(hit)
                    continue
            if text[i] == " ":
                j = i + 1
                while j < n and j - i <= 3 and "a" <= text[j] <= "z":
                    j += 1
                if j > i + 1:
                    out.append(self.piece_id[text[i:j]])
                    i = j
                    continue
            out.append(self.piece_id.get(text[i], 163838))
            i += 1
        return out

    def __call__(self, texts: str | list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts)}
        return {"input_ids": [self.encode(t) for t in texts]}

    def render(self, messages: list[dict[str, Any]], tools: list | None = None,
               add_generation_prompt: bool = False, thinking: bool = True) -> str:
        """The Kimi-style chat text for messages (and tools) with the generation prompt.

        The history rule of the real Kimi-K2-Thinking / K2.5 chat template (read in llama.cpp's copy,
        models/templates/moonshotai-Kimi-K2-Thinking.jinja; the K2.5 template splits at the same index):
        the messages up to and including the last assistant message *without tool calls* are history,
        where an assistant turn is rendered `<think></think>` + content (its reasoning dropped); after it
        (the current tool loop) an assistant turn keeps `<think>{reasoning_content}</think>`. Tool calls
        follow the content in their section, each `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS
        <|tool_call_end|>`; a tool result is a system turn `## Return of ID` + newline + content; a turn's
        name after its role token is the message's `name`, else its role. Not modelled: the real template
        injects a default system turn when the first message is not a system one, and K2.5 declares tools as
        TypeScript (`tools_ts_str`) where its tokenizer provides it; here tools are compact JSON and no
        system turn is added. The generation prompt ends `<think>` (reference §2), `<think></think>` with
        thinking off.
        """
        parts = []
        if tools:
            parts.append("<|im_system|>tool_declare<|im_middle|>" + json.dumps(tools, separators=(",", ":"))
                         + "<|im_end|>")
        role_tok = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}
        split = max((i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")),
                    default=-1)
        for i, m in enumerate(messages):
            role = m["role"]
            head = f"{role_tok.get(role, '<|im_system|>')}{m.get('name') or role}<|im_middle|>"
            content = m.get("content")
            if role == "assistant":
                reasoning = "" if i <= split else (m.get("reasoning_content") or "")
                body = f"<think>{reasoning}</think>{content or ''}"
                if m.get("tool_calls"):
                    body += "<|tool_calls_section_begin|>"
                    for c in m["tool_calls"]:
                        args = c["function"]["arguments"]
                        args = args if isinstance(args, str) else json.dumps(args)
                        body += f"<|tool_call_begin|>{c['id']}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
                    body += "<|tool_calls_section_end|>"
            elif role == "tool":
                body = f"## Return of {m.get('tool_call_id')}\n{content or ''}"
            else:
                body = content if content is not None else ""
            parts.append(f"{head}{body}<|im_end|>")
        if add_generation_prompt:
            parts.append("<|im_assistant|>assistant<|im_middle|>" + ("<think>" if thinking else "<think></think>"))
        return "".join(parts)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False, thinking: bool = True, **_: Any) -> Any:
        text = self.render(messages, tools, add_generation_prompt, thinking)
        return self.encode(text) if tokenize else text


def _words(rng: np.random.Generator, tok: SyntheticTokenizer, n: int) -> np.ndarray:
    """n ordinary ids: words, with a full stop or newline now and then (all canonical)."""
    ids = rng.choice(tok.word_ids, size=n)
    if n > 4:
        k = max(1, n // 12)
        at = rng.choice(np.arange(1, n), size=min(k, n - 1), replace=False)
        ids[at] = rng.choice([tok.piece_id["."], tok.piece_id[","], tok.piece_id["\n"]], size=len(at))
    return ids


def _tool_section(tok: SyntheticTokenizer, name: str, arg: str) -> list[int]:
    tc = tok.profile.tool_calls
    assert tc is not None and tc.section_begin and tc.section_end and tc.argument_begin
    return ([tc.section_begin.id, tc.call_begin.id] + tok.encode(f"functions.{name}:0") + [tc.argument_begin.id]
            + tok.encode(json.dumps({"query": arg})) + [tc.call_end.id, tc.section_end.id])


def synthetic_records(n: int, *, seed: int = 0, dataset: str = "synthetic", min_output: int = 200,
                      max_output: int = 8000, tool_share: float = 0.25, system_share: float = 0.5,
                      guard_share: float = 0.1, truncated_share: float = 0.0,
                      tokenizer: SyntheticTokenizer | None = None) -> list[dict[str, Any]]:
    """n valid kimi-k2.5-profile records (Record schema) with consistent ids, messages and text.

    Output length is log-uniform in [min_output, max_output] tokens: reasoning, `</think>`,
    an answer, optionally a tool-call section (the prompt then declares the tool), then
    `<|im_end|>` and sometimes the `[EOS]` guard. `truncated_share` of them stop at the
    length cap instead (finish_reason `length`).
    """
    tok = tokenizer or SyntheticTokenizer()
    p = tok.profile
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        total = int(np.exp(rng.uniform(np.log(min_output), np.log(max_output))))
        has_tool = rng.random() < tool_share
        tool_name = "get" + "".join(rng.choice(list(string.ascii_lowercase), size=5))
        msgs = []
        if has_tool or rng.random() < system_share:
            msgs.append({"role": "system", "content": "You are a careful assistant" + tok.decode_words(_words(rng, tok, 6))})
        msgs.append({"role": "user", "content": "Question:" + tok.decode_words(_words(rng, tok, int(rng.integers(8, 60))))})
        tools = [{"type": "function", "function": {"name": tool_name, "description": "Look something up.",
                                                   "parameters": {"type": "object", "properties": {
                                                       "query": {"type": "string"}}}}}] if has_tool else None
        prompt_ids = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, thinking=True)
        section = _tool_section(tok, tool_name, tok.decode_words(_words(rng, tok, 3))) if has_tool else []
        body = max(4, total - 2 - len(section))
        n_reason = max(1, int(body * rng.uniform(0.55, 0.9)))
        reasoning = _words(rng, tok, n_reason)
        answer = _words(rng, tok, max(1, body - n_reason))
        ids = np.concatenate([reasoning, [p.reasoning_close.id], answer, section, [p.end_of_turn.id]]).astype(np.int64)
        finish = "stop"
        if rng.random() < guard_share:
            ids = np.append(ids, p.guard.id)
        if rng.random() < truncated_share:
            ids = ids[: max(1, int(len(ids) * rng.uniform(0.3, 0.95)))]
            finish = "length"
        close_at = len(reasoning)
        r_text = tok.decode_words(ids[:close_at]) if close_at < len(ids) else tok.decode_words(ids)
        a_ids = answer[: max(0, len(ids) - close_at - 1)]
        out.append({
            "dataset": dataset, "sample_id": i, "source": "sglang", "model": "moonshotai/Kimi-K2.5",
            "profile": p.name, "messages": msgs, "tools": tools, "prompt_ids": [int(x) for x in prompt_ids],
            "output_ids": ids.tolist(), "ids_exact": True, "reasoning": r_text,
            "content": tok.decode_words(a_ids) if finish == "stop" else None,
            "tool_calls": [{"type": "function", "function": {"name": tool_name}}] if has_tool else None,
            "finish_reason": finish, "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": int(len(ids))},
            "provider": None, "cost_usd": None,
        })
    return out


def synthetic_id_table(n: int, *, seed: int = 0, min_output: int = 200, max_output: int = 8000,
                       tool_share: float = 0.25, profile: Profile = KIMI_K25, dtype: Any = np.int32) -> Any:
    """An IdTable of n valid kimi-profile records built with numpy only (for throughput runs)."""
    import pandas as pd

    from eagle3data.audit.idtable import IdTable

    tok = SyntheticTokenizer(profile)
    rng = np.random.default_rng(seed)
    L = np.exp(rng.uniform(np.log(min_output), np.log(max_output), size=n)).astype(np.int64)
    off = np.zeros(n + 1, np.int64)
    np.cumsum(L, out=off[1:])
    ids = rng.choice(tok.word_ids, size=int(off[-1])).astype(dtype)
    close = off[:-1] + (L * rng.uniform(0.55, 0.85, size=n)).astype(np.int64)
    ids[close] = profile.reasoning_close.id
    ids[off[1:] - 1] = profile.end_of_turn.id
    tc = profile.tool_calls
    if tc is not None and tc.section_begin is not None:
        sect = [tc.section_begin.id, tc.call_begin.id, 1, tc.argument_begin.id, 2, tc.call_end.id, tc.section_end.id]
        with_tool = np.flatnonzero((rng.random(n) < tool_share) & (off[1:] - 1 - close > len(sect) + 1))
        start = off[1:][with_tool] - 1 - len(sect)
        for j, t in enumerate(sect):
            ids[start + j] = t
    prompt_proto = np.asarray(tok.apply_chat_template([{"role": "user", "content": "Question: what is it"}],
                                                      add_generation_prompt=True), dtype=dtype)
    plen = rng.integers(1, 8, size=n) * 0 + len(prompt_proto)
    poff = np.zeros(n + 1, np.int64)
    np.cumsum(plen, out=poff[1:])
    prompt = np.tile(prompt_proto, n)
    meta = pd.DataFrame({"dataset": "synthetic", "sample_id": np.arange(n), "source": "sglang", "provider": None,
                         "finish_reason": "stop", "ids_exact": True, "line": np.arange(1, n + 1), "file": "memory"})
    return IdTable(meta, prompt, poff, np.ones(n, bool), ids, off, np.ones(n, bool))


def _load(spec: str, profile: Any = None) -> SyntheticTokenizer:
    """`synthetic:PROFILE` -> the stand-in vocabulary on that profile's ids."""
    from eagle3data.core.profiles import get_profile

    return SyntheticTokenizer(get_profile(spec))


def register() -> None:
    """Make `synthetic:PROFILE` a tokenizer source of `eagle3data.core.models.load_tokenizer`."""
    from eagle3data.core.models import register_tokenizer

    register_tokenizer("synthetic:", _load)


register()
