"""Prompt datasets and chat templating.

A prompt file is JSONL, one `{"sample_id", "messages", "tools"?}` per line. The loader
rejects a bad line with `file:line` and the reason, keeps going, and reports what it
skipped. Templating applies the model's chat template with the profile's options; where the
template has no tools support (SmolLM2), tool definitions go into the system prompt, as
glaive-style function-calling datasets do.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .profiles import Profile

BUILTIN_PREFIX = "builtin:"
ROLES = {"system", "user", "assistant", "tool"}


@dataclass
class Prompt:
    """One prompt: its dataset, id, chat messages and optional OpenAI-format tools."""

    dataset: str
    sample_id: int | str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass
class PromptSet:
    """Prompts of one dataset, plus the lines the loader rejected (`file:line: reason`)."""

    dataset: str
    path: Path
    prompts: list[Prompt] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def builtin_datasets() -> list[str]:
    """Names of the prompt sets shipped with the package."""
    root = resources.files("eagle3data") / "data" / "prompts"
    return sorted(p.name[: -len(".jsonl")] for p in root.iterdir() if p.name.endswith(".jsonl"))


def resolve_prompt_path(path: str) -> Path:
    """`builtin:NAME` -> the shipped file; anything else -> that path."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        p = Path(str(resources.files("eagle3data") / "data" / "prompts" / f"{name}.jsonl"))
        if not p.exists():
            raise FileNotFoundError(f"no builtin prompt set {name!r}; known: {', '.join(builtin_datasets())}")
        return p
    return Path(path)


def _check_line(obj: Any) -> str | None:
    """Why a parsed line is not a prompt, or None when it is one."""
    if not isinstance(obj, dict):
        return "line is not a JSON object"
    if "sample_id" not in obj:
        return "missing field `sample_id`"
    sid = obj["sample_id"]
    if isinstance(sid, bool) or not isinstance(sid, (int, str)) or sid == "":
        return f"field `sample_id` must be an integer or non-empty string, got {sid!r}"
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "field `messages` must be a non-empty list"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"field `messages[{i}]` must be an object"
        if m.get("role") not in ROLES:
            return f"field `messages[{i}].role` must be one of {sorted(ROLES)}, got {m.get('role')!r}"
        if not isinstance(m.get("content"), str):
            return f"field `messages[{i}].content` must be a string"
    if msgs[-1]["role"] != "user" and msgs[-1]["role"] != "tool":
        return f"field `messages` must end with a user or tool turn, ends with {msgs[-1]['role']!r}"
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            return "field `tools` must be a list"
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                return f"field `tools[{i}].function.name` is missing"
    extra = set(obj) - {"sample_id", "messages", "tools"}
    if extra:
        return f"unknown field(s) {', '.join(sorted(extra))}"
    return None


def load_prompts(path: str | Path, dataset: str | None = None) -> PromptSet:
    """Load one prompt JSONL; bad lines are skipped and reported as `file:line: reason`."""
    p = resolve_prompt_path(str(path))
    name = dataset or p.stem
    out = PromptSet(dataset=name, path=p)
    seen: dict[str, int] = {}
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                out.skipped.append(f"{where}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            reason = _check_line(obj)
            if reason is None and str(obj["sample_id"]) in seen:
                reason = f"duplicate sample_id {obj['sample_id']!r} (first on line {seen[str(obj['sample_id'])]})"
            if reason:
                out.skipped.append(f"{where}: {reason}")
                continue
            seen[str(obj["sample_id"])] = lineno
            out.prompts.append(Prompt(name, obj["sample_id"], obj["messages"], obj.get("tools")))
    return out


def load_datasets(params: Any) -> dict[str, PromptSet]:
    """Prompt sets of a run, each shuffled with the run's seed and cut to its `limit`."""
    sets: dict[str, PromptSet] = {}
    seed = params.generate.sampling.seed
    for d in params.datasets:
        ps = load_prompts(d.path, d.name)
        rng = random.Random(f"{seed}:{d.name}")
        rng.shuffle(ps.prompts)
        if d.limit is not None:
            ps.prompts = ps.prompts[: d.limit]
        sets[d.name] = ps
    return sets


def tools_as_system_text(tools: list[dict[str, Any]]) -> str:
    """Tool definitions as glaive-style system-prompt text, for templates without tools."""
    lines = ["You have access to the following functions. To call one, answer with JSON "
             '{"name": <function name>, "arguments": <arguments object>}.']
    for t in tools:
        lines.append(json.dumps(t.get("function", t), ensure_ascii=False, indent=2))
    return "\n".join(lines)


def messages_for_template(prompt: Prompt, profile: Profile) -> tuple[list[dict[str, Any]], list | None]:
    """Messages and tools as the chat template takes them for this profile."""
    msgs = [dict(m) for m in prompt.messages]
    if not prompt.tools or profile.template_supports_tools:
        return msgs, prompt.tools
    tool_text = tools_as_system_text(prompt.tools)
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = msgs[0]["content"].rstrip() + "\n\n" + tool_text
    else:
        msgs.insert(0, {"role": "system", "content": tool_text})
    return msgs, None


def template_prompt(tokenizer: Any, prompt: Prompt, profile: Profile) -> list[int]:
    """Prompt ids: the chat template with the generation prompt and the profile's options."""
    msgs, tools = messages_for_template(prompt, profile)
    kwargs = dict(profile.template_kwargs)
    if tools:
        kwargs["tools"] = tools
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
    if isinstance(ids, dict):  # some tokenizers ignore return_dict=False
        ids = ids["input_ids"]
    return [int(i) for i in ids]
