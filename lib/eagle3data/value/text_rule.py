"""`text_rule`: the rows a text-only trainer trains on, made from the run's conversations (issue 60).

The ids are 05's text rule (`export/text_drift.py`: the record's messages and its reply as the final
assistant turn, rendered by the target's own chat template as text, encoded without special tokens: `rule_ids`);
the loss mask is the one TorchSpec builds for them; the kind compares the ids with ours (`text_drift.drift_kind`,
the rule `DriftCount` counts with). The two text trainers build different masks; TorchSpec's is the assistant
mask, Model-Optimizer's default is none, so `text_rule_rows` makes TorchSpec's (`peer="modelopt"`: the other).

**TorchSpec** (lightseekorg/TorchSpec at 6f21829, 2026-04-28; `torchspec/data/parse.py` as of 9d072fc reads the
same). `torchspec/data/dataset.py::load_conversation_dataset` (`defer_tokenization` false, its default in
`torchspec/config/train_config.py`) → `_tokenize_single` →
`torchspec/data/preprocessing.py::preprocess_conversations` → `torchspec/data/parse.py::GeneralParser.format`
(the tokenizer's own template, `add_generation_prompt` false) and `GeneralParser.parse` →
`Parser._tokenize_with_loss_mask`:
- a span is the text after each occurrence of the registry template's `assistant_header` up to and including the
  first `end_of_turn_token` after it (or the end of the text). A ChatML target takes the registry's `qwen` entry
  (`torchspec/data/template.py`; its Qwen3-8B configs do; there is no SmolLM2 entry): header `<|im_start|>assistant\\n`,
  end `<|im_end|>\\n`. So the header is not supervised; the content, `<|im_end|>` and the newline after it are;
- a span becomes tokens by encoding the text up to its start and up to its end (no special tokens, no offsets):
  tokens `len(encode(text[:start]))` to `len(encode(text[:end]))`;
- every assistant turn of the conversation is supervised (our `messages` history included), unless
  `last_turn_loss_only` (default `"auto"`: only the last turn when the conversation has real thinking,
  `parse.py::has_thinking_content`: an assistant content with a non-empty `<think>`, or a `thinking`,
  `thinking_content`, `reasoning_content` or `reasoning` field);
- reasoning is supervised wherever the target's template renders it inside the turn (Qwen3's `<think>…</think>` of
  the last turn); SmolLM2's template drops `reasoning_content`. Tool calls rendered in the turn are supervised
  (SmolLM2: the JSON that `messages_for_template` puts in the content); tool definitions (system) and tool results
  (`<|im_start|>tool` turns) are not, nor user turns;
- a reply cut at the budget: the template still closes the turn with `<|im_end|>\\n`, and both are supervised;
- a row with nothing supervised is dropped (never here: every row has its reply's end-of-turn).
Where TorchSpec's own ids would differ from `rule_ids`: `GeneralParser.format` puts the registry template's
`system_prompt` first when the conversation has no system message (`qwen`: "You are a helpful assistant."; SmolLM2's
own template would put its SmolLM one there), and cuts a conversation whose roles do not alternate. `text_rule` keeps
the target's own rendering, the ids 05 counts; a registry's template is `template_other`'s question. Its other mask
path, `defer_tokenization` true (its Kimi-K2.5 configs), is
`torchspec/models/ops/loss_mask.py::compute_assistant_loss_mask` on the engine's ids, from after the header to before
the end's ids: the end-of-turn and its newline are not supervised. The `kimi-k25-vlm` entry's `KimiK25Parser`
renders its own text, and its span stops before `<|im_end|>`.

**Model-Optimizer** (NVIDIA/Model-Optimizer at a2fbac7, 2026-08-21). `examples/speculative_decoding/eagle_utils.py::
make_speculative_data_module`: the streaming dataset (`modelopt/torch/speculative/plugins/hf_streaming_dataset.py::
_tokenize_with_loss_mask`, `apply_chat_template(tokenize=True, add_generation_prompt=False)`: `rule_ids`' ids) and
the online collator (`modelopt/torch/utils/plugins/transformers_dataset.py::LanguageDataCollator`). With
`answer_only_loss` false, the default (`StreamingConfig`; PR #548 took the answer-only mask out so the draft learns
user turns too), the mask is all ones: every token, system prompt, user turns and headers included. With it true the
template must carry `{% generation %}` tags (SmolLM2's has none: it raises) and the mask is transformers'
`assistant_masks` over what the user's tagged copy wraps; in the online EAGLE path (`plugins/hf_eagle.py`, forward)
the draft's loss mask is the attention mask either way (the labels reach only the base model's loss).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from eagle3data.export.text_drift import drift_kind, encode_texts, rule_messages, rule_texts
from eagle3data.value.peer_rows import PeerRow

PEERS = ("torchspec", "modelopt")
MADE_BY = ("TorchSpec's text path: the target's chat template as text, encoded without special tokens (export/"
           "text_drift.py::rule_ids, Model-Optimizer's ids too), loss mask of torchspec/data/parse.py::"
           "Parser._tokenize_with_loss_mask (each assistant turn's content, end-of-turn and newline; the last turn "
           "only where the conversation has reasoning)")

# TorchSpec's registry entry (torchspec/data/template.py) for each profile's family: (name, assistant_header,
# end_of_turn_token, whether the span includes that end: GeneralParser's does, KimiK25Parser's does not)
TORCHSPEC_TEMPLATES: dict[str, tuple[str, str, str, bool]] = {
    "smollm2": ("qwen", "<|im_start|>assistant\n", "<|im_end|>\n", True),
    "qwen3": ("qwen", "<|im_start|>assistant\n", "<|im_end|>\n", True),
    "kimi-k2.5": ("kimi-k25-vlm", "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>", False),
}

_REAL_THINKING = re.compile(r"<think>(?!\s*</think>)")
_THINKING_FIELDS = ("thinking", "thinking_content", "reasoning_content", "reasoning")


def has_thinking(messages: Sequence[dict[str, Any]]) -> bool:
    """TorchSpec's `last_turn_loss_only: auto` test: an assistant message with real thinking (a `<think>` not
    closed at once in its content, or a non-empty thinking field)."""
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        content = m.get("content")
        if isinstance(content, str) and _REAL_THINKING.search(content):
            return True
        if any(m.get(f) for f in _THINKING_FIELDS):
            return True
    return False


def assistant_spans(text: str, profile: Any, *, last_turn_only: bool = False) -> list[tuple[int, int]]:
    """Character spans TorchSpec supervises in a rendered conversation: after each assistant header, to the end of
    the turn (its end-of-turn included where its parser includes it)."""
    if profile.name not in TORCHSPEC_TEMPLATES:
        raise ValueError(f"no TorchSpec template known for profile {profile.name!r} "
                         f"(known: {', '.join(TORCHSPEC_TEMPLATES)})")
    _, header, end, end_in = TORCHSPEC_TEMPLATES[profile.name]
    body = f"(.*?(?:{re.escape(end)}|$))" if end_in else f"(.*?){re.escape(end)}"
    spans = [m.span(1) for m in re.finditer(re.escape(header) + body, text, flags=re.S)]
    return spans[-1:] if last_turn_only else spans


def _prefix_lengths(tokenizer: Any, texts: Sequence[str], spans: Sequence[list[tuple[int, int]]]) -> list[list[int]]:
    """For each text, the token count of the text up to each span's start and end (one batch for all)."""
    prefixes = [t[:c] for t, sp in zip(texts, spans) for span in sp for c in span]
    counts = iter(len(ids) for ids in encode_texts(tokenizer, prefixes))
    return [[next(counts) for _ in range(2 * len(sp))] for sp in spans]


def torchspec_mask(n: int, bounds: Sequence[int]) -> list[int]:
    """A 0/1 mask of n tokens, 1 from each span's start token to its end token (pairs in `bounds`, cut at n)."""
    mask = [0] * n
    for a, b in zip(bounds[::2], bounds[1::2]):
        a, b = min(a, n), min(b, n)
        mask[a:b] = [1] * max(0, b - a)
    return mask


def text_rule_rows(tokenizer: Any, profile: Any, samples: Sequence[Any], *, peer: str = "torchspec") -> list[PeerRow]:
    """Each sample as a text-only trainer trains on it: `rule_ids`' ids, the peer's loss mask (TorchSpec's
    assistant mask; `peer="modelopt"`: Model-Optimizer's default, every token), the kind against our exact ids.

    `samples`: `core.reader.Sample`s with their record kept (messages, tools, reasoning, content, tool_calls)."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}: one of {', '.join(PEERS)}")
    if any(s.record is None for s in samples):
        raise ValueError("text_rule needs each sample's record (read the mix with keep_record=True)")
    texts = rule_texts(tokenizer, samples, profile)
    ids = encode_texts(tokenizer, texts)
    if peer == "modelopt":
        masks = [[1] * len(i) for i in ids]
    else:
        spans = [assistant_spans(t, profile, last_turn_only=has_thinking(rule_messages(s, profile)[0]))
                 for t, s in zip(texts, samples)]
        masks = [torchspec_mask(len(i), b) for i, b in zip(ids, _prefix_lengths(tokenizer, texts, spans))]
    eot = set(profile.stop_ids)
    return [PeerRow(key=s.key, input_ids=i, loss_mask=m, kind=drift_kind(list(s.input_ids), i, eot))
            for s, i, m in zip(samples, ids, masks)]
