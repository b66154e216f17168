"""03's tokenizer checks on a chunk of records, in batches: the prompt's text, re-templating, decode→encode, text fields.

Each check decides what the per-record calls decide (`tokenizer.decode(ids, skip_special_tokens=False)`,
`tokenizer.encode(text, add_special_tokens=False)`, `template_prompt`, `spans.output_texts`), with the
work of a chunk handed to the tokenizer in batch calls: for a fast tokenizer (`tokenizers`' Rust
backend) `decode_batch` and `encode_batch` run the records in parallel, outside the GIL. `_Codec`
takes the backend only where its batch calls give exactly what the per-record calls give (no
truncation or padding set, no clean-up of tokenization spaces, the same special-token splitting);
any other tokenizer (a slow one, the tests' stand-in) is called record by record, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from eagle3data.audit.checks import FAIL, NA, NOT_RUN, PASS
from eagle3data.audit.idtable import IdTable
from eagle3data.core.profiles import Profile
from eagle3data.core.spans import texts_of_splits
from eagle3data.prompts.load import Prompt, messages_for_template

TEXT_CHECKS = ("prompt.tools_present", "prompt.system_present", "prompt.retemplate", "text.fields_match")
_BATCH_TOKENS = 1 << 18  # output tokens per encode call: the tokenizer's per-token results of one call stay small


def _norm(s: str) -> str:
    return " ".join(s.split())


def _same_text(a: str, b: Any) -> bool:
    """Equal after whitespace normalisation (equal texts are, without normalising them)."""
    return a == b or _norm(a) == _norm(b)


class _Codec:
    """decode/encode of many sequences with the per-record calls' results, batched where that is exact."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        bt = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if bt is not None and (bt.truncation is not None or bt.padding is not None
                               or getattr(tokenizer, "clean_up_tokenization_spaces", False)
                               or bool(getattr(bt, "encode_special_tokens", False))
                               != bool(getattr(tokenizer, "split_special_tokens", False))):
            bt = None  # transformers would change what the backend returns: per-record calls decide
        self.bt = bt

    def decode(self, runs: Sequence[list[int]]) -> list[str]:
        if not runs:
            return []
        if self.bt is not None:
            return self.bt.decode_batch(list(runs), skip_special_tokens=False)
        return [self.tok.decode(r, skip_special_tokens=False) for r in runs]

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.bt is not None:
            return [e.ids for e in self.bt.encode_batch(list(texts), add_special_tokens=False)]
        return [list(self.tok.encode(t, add_special_tokens=False)) for t in texts]


def _batches(rows: list[int], lens: np.ndarray, budget: int = _BATCH_TOKENS) -> list[list[int]]:
    """`rows` in consecutive groups of about `budget` tokens (at least one row each)."""
    out: list[list[int]] = []
    cur: list[int] = []
    acc = 0
    for i in rows:
        cur.append(i)
        acc += int(lens[i])
        if acc >= budget:
            out.append(cur)
            cur, acc = [], 0
    if cur:
        out.append(cur)
    return out


def _system_text(msgs: Any) -> str | None:
    """The first non-empty system message's content, or None."""
    for m in msgs or []:
        if isinstance(m, dict) and m.get("role") == "system" and str(m.get("content") or "").strip():
            return str(m["content"])
    return None


def _render(tokenizer: Any, prompt: Prompt, profile: Profile) -> str:
    """A prompt rendered by the chat template, as `prompts.load.template_prompts` renders it before encoding."""
    msgs, tools = messages_for_template(prompt, profile)
    kwargs = dict(profile.template_kwargs)
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kwargs)


@dataclass
class TextWork:
    """A chunk's tokenizer checks, prepared (the Python side: ids as lists, templates rendered, outputs split) for
    `run_text_checks` to finish (the tokenizer's batch calls and the comparisons), possibly in another thread."""

    st: dict[str, np.ndarray]
    pids: dict[int, list[int]]  # prompt ids of the rows with a prompt
    decode_rows: list[int]  # rows whose decoded prompt the tools/system checks read
    tools: dict[int, list[str | None]]  # row -> the tool names its prompt must show
    system: dict[int, str]  # row -> the system prompt (normalised, first 200 characters) its prompt must show
    rendered: dict[int, str | None]  # row -> its messages rendered by the template (None: the template failed)
    batches: list[tuple[list[int], list[list[int]]]]  # (rows, their output ids) per batch
    splits: list[tuple[list[int], list[Any]]]  # per batch, (rows with text fields, their output's one split)
    fields: dict[int, tuple[Any, Any]]  # row -> its (reasoning, content) fields
    roundtrip: bool


def prepare_text_checks(table: IdTable, profile: Profile, tokenizer: Any, *, roundtrip: bool = True) -> TextWork:
    """The Python side of a chunk's tokenizer checks: nothing here calls the tokenizer's encoder or decoder."""
    n = len(table)
    st = {k: np.full(n, NA, np.int8) for k in TEXT_CHECKS}
    st["text.roundtrip"] = np.full(n, NA if roundtrip else NOT_RUN, np.int8)
    msgs_all = table.messages or [None] * n
    tools_all = table.tools or [None] * n
    rows = np.flatnonzero(table.has_prompt).tolist()
    pids = {i: table.prompt_ids(i).tolist() for i in rows}
    tools, system = {}, {}
    for i in rows:
        if tools_all[i]:
            tools[i] = [(t.get("function") or t).get("name") for t in tools_all[i] if isinstance(t, dict)]
        sys_text = _system_text(msgs_all[i])
        if sys_text is not None:
            system[i] = _norm(sys_text)[:200]
    rendered: dict[int, str | None] = {}
    for i in rows:
        if msgs_all[i]:
            try:
                rendered[i] = _render(tokenizer, Prompt(str(table.meta.at[i, "dataset"]), table.meta.at[i, "sample_id"],
                                                        msgs_all[i], tools_all[i]), profile)
            except Exception:  # a template that cannot render these messages is a failure too
                rendered[i] = None
    fr = table.meta["finish_reason"].to_numpy(dtype=object)
    usable = np.flatnonzero(table.has_output & ((fr == "stop") | (fr == "length"))).tolist()
    reasoning_all = table.reasoning or [None] * n
    content_all = table.content or [None] * n
    fields = {i: (reasoning_all[i], content_all[i]) for i in usable
              if reasoning_all[i] is not None or content_all[i] is not None}
    batches, splits = [], []
    for b in _batches(usable, table.output_len):
        outs = [table.output_ids(i).tolist() for i in b]
        batches.append((b, outs))
        have = [k for k, i in enumerate(b) if i in fields]
        splits.append(([b[k] for k in have], [profile.split_output(outs[k]) for k in have]))
    return TextWork(st, pids, sorted(set(tools) | set(system)), tools, system, rendered, batches, splits, fields,
                    roundtrip)


def run_text_checks(work: TextWork, profile: Profile, tokenizer: Any) -> dict[str, np.ndarray]:
    """Finish a chunk's tokenizer checks: the batch calls, then each record's statuses (`work.st`, returned).

    `text.roundtrip`: `encode(decode(ids)) == ids` (the outputs decoded and encoded in batch calls);
    `text.fields_match`: the record's reasoning/content == the text of the one split of its ids
    (`spans.texts_of_splits`, decoded in one batch), whitespace-normalised; the prompt's checks on its
    decoded text and its re-templating (the rendered texts encoded in one call)."""
    st, codec = work.st, _Codec(tokenizer)
    for i, text in zip(work.decode_rows, codec.decode([work.pids[i] for i in work.decode_rows])):
        text = _norm(text)
        if i in work.tools:
            st["prompt.tools_present"][i] = PASS if all(nm and nm in text for nm in work.tools[i]) else FAIL
        if i in work.system:
            st["prompt.system_present"][i] = PASS if work.system[i] in text else FAIL
    rows = [i for i, text in work.rendered.items() if text is not None]
    texts = [work.rendered[i] for i in rows]
    # as template_prompts encodes them: one call of the tokenizer (the backend's batch call, where that is exact)
    again = codec.encode(texts) if codec.bt is not None or not texts else \
        [[int(t) for t in ids] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    for i, ids in zip(rows, again):
        st["prompt.retemplate"][i] = PASS if ids == work.pids[i] else FAIL
    for i, text in work.rendered.items():
        if text is None:
            st["prompt.retemplate"][i] = FAIL
    for (rows, outs), (have, splits) in zip(work.batches, work.splits):
        if work.roundtrip:
            for i, ids, back in zip(rows, outs, codec.encode(codec.decode(outs))):
                st["text.roundtrip"][i] = PASS if back == ids else FAIL
        for i, text in zip(have, texts_of_splits(splits, profile, tokenizer)):  # the one split, as exact backends write it
            reasoning, content = work.fields[i]
            ok = True
            if reasoning is not None and text.reasoning is not None:
                ok &= _same_text(text.reasoning, reasoning)
            if content is not None:
                ok &= _same_text(text.content, content)
            st["text.fields_match"][i] = PASS if ok else FAIL
    return st
