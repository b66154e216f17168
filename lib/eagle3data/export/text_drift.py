"""What a trainer that takes only text would train on: the mix's conversations re-tokenized by the trainers' rule.

TorchSpec (`load_conversation_dataset`) and Model-Optimizer's streaming dataset read conversations,
not ids: they render the target's chat template as text and encode it without special tokens
(`apply_chat_template(tokenize=False)`, then `encode(add_special_tokens=False)`, or
`apply_chat_template(tokenize=True)`, which does the same). Everything 01–03 proved about the ids is
then lost at the last step unless that rule happens to give the same ids. This module applies the
rule to every row of the mix (the record's messages plus its reply as the final assistant turn, the
profile's template options, `prompts.load.messages_for_template`'s handling of tools) and counts for
how many rows it reproduces the exact ids:

- `equal`: the rule's ids are ours, token for token;
- `equal_then_template_tail`: ours, then only what the template appends after the end-of-turn the
  model emitted (ChatML's newline after `<|im_end|>`): the ids up to it are ours (TorchSpec's loss mask
  supervises that newline too: value/text_rule.py);
- `differ`: anything else, by kind (`differ_kinds`): `end_of_turn_added` (a reply cut at the
  budget: the template closes the turn with an end-of-turn the model never emitted there, and the
  trainer supervises it) or `inside` (another split, a token missing or added within the sequence).
  The first ones are named, with the position and the tokens on both sides.

`reproduced` = the first two. `drift_kind` is the one rule for a row's kind (06's `text_rule` rows take theirs
from it too). The figure is the run's, whatever trainer it goes to; what such a drift costs a drafter is 06's
`text_rule` variant (value/text_rule.py: these ids with the trainer's own loss mask), not `retokenized` (02's
proven rebuild, which knows the finish reason and never adds that end-of-turn).
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

from eagle3data.core.models import tokenizer_for
from eagle3data.core.profiles import get_profile
from eagle3data.export.rows import chunks_of
from eagle3data.prompts.load import Prompt, messages_for_template
from eagle3data.rebuild.provider_tokens import fast_backend
from eagle3data.rebuild.text import first_diff

RULE = ("the target's chat template rendered as text (the record's messages, then its reply as the final assistant "
        "turn with reasoning_content; the profile's template options), encoded without special tokens: TorchSpec's "
        "and Model-Optimizer's tokenization")
SHOW = 5  # differing rows named in the manifest
WINDOW = 4  # tokens shown on each side of a row's first difference


def rule_messages(sample: Any, profile: Any) -> tuple[list[dict[str, Any]], list | None]:
    """The conversation the rule renders for a sample: the record's messages, then its reply as the final assistant
    turn (with `reasoning_content` and its tool calls), as `prompts.load.messages_for_template` gives them."""
    rec = sample.record or {}
    reply = {"role": "assistant", "content": rec.get("content") or "", "reasoning_content": rec.get("reasoning") or ""}
    if rec.get("tool_calls"):
        reply["tool_calls"] = rec["tool_calls"]
    prompt = Prompt(sample.dataset, sample.sample_id, [*(rec.get("messages") or []), reply], rec.get("tools"))
    return messages_for_template(prompt, profile)


def rule_texts(tokenizer: Any, samples: Sequence[Any], profile: Any) -> list[str]:
    """Each sample's conversation rendered by the target's chat template as text (the profile's template options)."""
    texts = []
    for s in samples:
        msgs, tools = rule_messages(s, profile)
        kw = dict(profile.template_kwargs) | ({"tools": tools} if tools else {})
        texts.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **kw))
    return texts


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Texts encoded without special tokens, in one batch (the fast tokenizer's `encode(add_special_tokens=False)`)."""
    if not texts:
        return []
    return [list(e.ids) for e in fast_backend(tokenizer).encode_batch_fast(list(texts), add_special_tokens=False)]


def rule_ids(tokenizer: Any, samples: Sequence[Any], profile: Any) -> list[list[int]]:
    """The ids the text trainers' rule gives each sample's conversation (rendered one by one, encoded in one batch)."""
    return encode_texts(tokenizer, rule_texts(tokenizer, samples, profile))


def drift_kind(ours: Sequence[int], theirs: Sequence[int], eot_ids: Collection[int]) -> str:
    """How a row's rule ids compare with its exact ids: one of `value.peer_rows.KINDS` (this module's docstring)."""
    d = first_diff(ours, theirs)
    if d is None:
        return "equal"
    if d == len(ours) and ours and ours[-1] in eot_ids:  # ours, then only the template's tail after our end-of-turn
        return "equal_then_template_tail"
    if d == len(ours) and d < len(theirs) and theirs[d] in eot_ids:  # a reply cut at the budget gets an end-of-turn
        return "end_of_turn_added"  # the model never emitted there
    return "inside"


def _view(tokenizer: Any, ids: Sequence[int]) -> list[list[Any]]:
    bt = fast_backend(tokenizer)
    return [[int(i), bt.decode([int(i)], skip_special_tokens=False)] for i in ids]


class DriftCount:
    """`text_drift` a chunk of rows at a time (`add`), the figure at the end (`result`): memory is one chunk's texts
    and ids plus the differing rows' keys. With `not_measured` (no tokenizer here) it only counts the rows."""

    def __init__(self, tokenizer: Any, profile: Any, not_measured: str | None = None) -> None:
        self.tokenizer, self.profile, self.why = tokenizer, profile, not_measured
        self.rows = self.equal = self.tail = 0
        self.kinds: dict[str, int] = {}
        self.differing: list[dict[str, Any]] = []

    def add(self, samples: Sequence[Any]) -> None:
        self.rows += len(samples)
        if self.why is not None or not samples:
            return
        tokenizer, eot = self.tokenizer, set(self.profile.stop_ids)
        for s, theirs in zip(samples, rule_ids(tokenizer, samples, self.profile)):
            ours = list(s.input_ids)
            kind = drift_kind(ours, theirs, eot)
            if kind == "equal":
                self.equal += 1
                continue
            if kind == "equal_then_template_tail":
                self.tail += 1
                continue
            d = first_diff(ours, theirs)
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if len(self.differing) < SHOW:
                lo = max(0, d - WINDOW)
                self.differing.append({"key": str(s.key), "kind": kind, "position": d, "ours_len": len(ours),
                                       "theirs_len": len(theirs), "ours": _view(tokenizer, ours[lo: d + WINDOW]),
                                       "theirs": _view(tokenizer, theirs[lo: d + WINDOW]), "window_start": lo})
            else:
                self.differing.append({"key": str(s.key), "kind": kind, "position": d})

    def result(self) -> dict[str, Any]:
        if self.why is not None:
            return {"rows": self.rows, "reproduced": None, "rule": RULE, "not_measured": self.why}
        n, equal, tail = self.rows, self.equal, self.tail
        return {"rows": n, "reproduced": equal + tail, "equal": equal, "equal_then_template_tail": tail,
                "differ": n - equal - tail, "differ_kinds": dict(sorted(self.kinds.items())),
                "first_differing": self.differing[:SHOW], "differing_keys": [x["key"] for x in self.differing],
                "rule": RULE}


def text_drift(samples: Any, tokenizer: Any, profile: Any) -> dict[str, Any]:
    """For how many rows the text trainers' rule reproduces the exact ids, the first differing rows named."""
    count = DriftCount(tokenizer, profile)
    for chunk in chunks_of(samples):
        count.add(chunk)
    return count.result()


def counter(params: Any) -> DriftCount:
    """A `DriftCount` with the run's tokenizer, or one that says why it does not measure (the tokenizer is not on
    this machine, or has no chat template)."""
    try:
        tok = tokenizer_for(params)
    except Exception as e:  # noqa: BLE001 - a tokenizer only the GPU machine has: said, not fatal
        return DriftCount(None, None, f"the run's tokenizer could not be loaded here ({type(e).__name__}: {e})")
    if getattr(tok, "chat_template", None) is None:
        return DriftCount(None, None, "the tokenizer has no chat template: a text-only trainer cannot render these rows")
    return DriftCount(tok, get_profile(params.profile))


def measure(params: Any, samples: Any) -> dict[str, Any]:
    """`text_drift` with the run's tokenizer, or why it was not measured, a chunk of rows at a time."""
    count = counter(params)
    for chunk in chunks_of(samples):
        count.add(chunk)
    return count.result()


def drift_line(d: dict[str, Any]) -> str:
    """One line: the text trainers' rule against the exact ids."""
    if d.get("reproduced") is None:
        return f"text-only trainers: not measured ({d.get('not_measured')})"
    first = ", ".join(d["differing_keys"][:3])
    kinds = ", ".join(f"{k} {v}" for k, v in (d.get("differ_kinds") or {}).items())
    return (f"text-only trainers (TorchSpec, Model-Optimizer: chat template as text, encoded): {d['reproduced']} of "
            f"{d['rows']} rows get our exact ids" + (f"; {d['differ']} differ ({kinds}; first: {first})"
                                                     if d["differ"] else ""))
