"""SpecForge 0.2.0's own text path for 06's `template_other` variant: each sample's row as its trainer builds it from
the conversation text (issue 60).

SpecForge's online trainer given raw conversations (`data.train_data_path`: ShareGPT-style `conversations`, what 05
writes as `conversations.jsonl`) tokenizes them itself: `data/prompt_builder.py::prepare_prompt_tasks` ->
`_prepare_raw_prompts` (datasets' `load_dataset("json")`) -> `data/preprocessing.py::build_eagle3_dataset` ->
`preprocess_conversations` -> `data/parse.py::GeneralParser.parse`, with the template `data.chat_template` names in
its own registry (`data/template.py::TEMPLATE_REGISTRY`). Read in the installed 0.2.0, `GeneralParser.parse`:

- takes the conversation's own first `system` message, or else inserts the registry template's `system_prompt`;
- keeps only `role`, `content` and `tool_calls` of each message (`_sanitize_message`: `reasoning_content`,
  `tool_call_id`, `name` go) and renders them with **the tokenizer's own chat template**
  (`apply_chat_template(tokenize=False)`, `tools=` the row's tools), encoded with `add_special_tokens=False` and cut
  at `data.max_length`;
- supervises every span its template's assistant pattern matches: after `assistant_header`, up to and including
  `end_of_turn_token` (all assistant turns: `train_only_last_turn` is false by default), the token positions found
  by encoding the text up to each span's ends.

The registry has no SmolLM2 template. Its ChatML one is `qwen` (`<|im_start|>assistant\\n` headers, `<|im_end|>\\n`
ends) with the system prompt "You are a helpful assistant.", where SmolLM2's own template (the one vLLM serves with)
inserts "You are a helpful AI assistant named SmolLM, trained by Hugging Face" into a conversation without a system
message. So on this target SpecForge trains the draft on a system prompt the server never shows it: what
`template_other` prices. SmolLM2's template renders only `content`: a row's tool definitions (ours put them into the
system prompt, as `prompts.load.messages_for_template` does for a template without tools) and earlier tool calls are
not in SpecForge's text.

`template_other_rows` calls SpecForge's `preprocess_conversations` itself (not a copy of it) on each sample's
conversation as 05 writes it (`export.run.conversation`: the record's messages, then its reply with
`reasoning_content` and `tool_calls` as the final assistant turn), so its ids and mask are SpecForge's, unchanged.
Between that file and `preprocess_conversations` SpecForge's path adds only datasets' JSON loading, whose schema
fills keys a message lacks with None (`tool_calls: None`, ...): SmolLM2's template reads neither, and
`tests/test_value_peers.py` runs the whole path (`prepare_prompt_tasks`) to the same rows. Nothing of it needs CUDA:
`specforge.data` imports and runs on a CPU-only torch. It sets `tokenizer.pad_token_id` to the unknown token's id
when the tokenizer has none (SmolLM2's has one: nothing changes).
"""

from __future__ import annotations

from typing import Any, Sequence

from eagle3data.export.run import conversation
from eagle3data.export.text_drift import drift_kind
from eagle3data.value.peer_rows import PeerRow

TEMPLATE = "qwen"  # SpecForge's ChatML template: the registry's nearest to SmolLM2's (no SmolLM2 template there)
MADE_BY = (f"SpecForge 0.2.0's data.train_data_path path: data/preprocessing.py::preprocess_conversations on the "
           f"conversation as 05 writes it, template {TEMPLATE!r} from its TEMPLATE_REGISTRY, the target's tokenizer")


def specforge_max_length() -> int:
    """SpecForge's default `data.max_length` (`config/schema.py::DataConfig`)."""
    from specforge.config.schema import DataConfig

    return int(DataConfig.model_fields["max_length"].default)


def specforge_row(tokenizer: Any, conv: dict[str, Any], *, template: str = TEMPLATE,
                  max_length: int | None = None) -> tuple[list[int], list[int]]:
    """SpecForge's ids and loss mask of one conversation (`{"conversations": [...], "tools": [...]}`, 05's line):
    `preprocess_conversations` as `build_eagle3_dataset` calls it for a ShareGPT row, its output as lists."""
    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY

    out = preprocess_conversations(tokenizer, [conv["conversations"]], TEMPLATE_REGISTRY.get(template),
                                   max_length or specforge_max_length(), is_preformatted=False,
                                   train_only_last_turn=False, tools=[conv.get("tools") or []])
    if not out["input_ids"]:  # it skips an empty conversation; 05 never writes one (the reply is always a turn)
        raise ValueError(f"{conv.get('id')}: SpecForge's preprocess_conversations made no row of this conversation")
    return out["input_ids"][0][0].tolist(), out["loss_mask"][0][0].tolist()


def template_other_rows(tokenizer: Any, profile: Any, samples: Sequence[Any], *,
                        max_length: int | None = None) -> list[PeerRow]:
    """Each sample's row as SpecForge's text path makes it with its `qwen` template (`specforge_row` on 05's
    conversation of the sample's record; samples need their record: `keep_record=True`), its kind against the
    sample's exact ids (`text_drift.drift_kind`). `max_length`: SpecForge's `data.max_length` (None: its default)."""
    eot = set(profile.stop_ids)
    rows = []
    for s in samples:
        if s.record is None:
            raise ValueError(f"{s.key}: template_other needs the sample's record (its conversation): read the samples "
                             "with keep_record=True")
        ids, mask = specforge_row(tokenizer, conversation(s.record), max_length=max_length)
        rows.append(PeerRow(s.key, ids, mask, drift_kind(list(s.input_ids), ids, eot)))
    return rows
