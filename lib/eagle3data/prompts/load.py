"""Prompt datasets and chat templating.

A prompt dataset is a file (or a folder of shards) in one of the published formats of
`formats.py`; each row becomes a `Prompt`: `sample_id`, the chat `messages` sent to the
model, optional OpenAI-format `tools`, the whole normalized `conversation` (every turn of the
row, the dataset's own replies included) and `meta` (card fields kept, and
`reference_reply`: the trailing assistant turn cut off for single-turn regeneration).
`format: prompts` is this project's strict JSONL (`{"sample_id", "messages", "tools"?}`).

Files (`promptfiles.py` reads them): `.jsonl` and `.json` are read line by line (or element
by element), so a bad row (a line that is not UTF-8 included) is named by `file:line` and never
sinks the rest; a file in another encoding is refused in one line; `.parquet`, `.arrow`, a
folder of shards (or a downloaded dataset repository) and `hf:NAME` go through the HF
`datasets` library (streamed, rows named `file row N`). The loader rejects a bad row with its
location and reason, keeps going, drops exact-duplicate prompts (counted), and reports what it
skipped. `check_source` reads the first rows of each file before any work (wrong format, every
row bad, several configs and no `subset`).
Sample ids come from the row's id field where the format has one, else from a content hash
of the prompt (never a line number: rows reorder between releases).

Templating applies the model's chat template with the profile's options; where the template
has no tools support (SmolLM2), tool definitions go into the system prompt, as glaive-style
function-calling datasets do.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import orjson

from eagle3data.prompts.formats import ROLES, DatasetFormat, RowError, accepting_formats, get_format, guess_formats
from eagle3data.core.atomic import atomic_path
from eagle3data.core.params import ParamsError
from eagle3data.core.profiles import Profile
from eagle3data.prompts.files import (BUILTIN_PREFIX, COLUMNAR_SUFFIXES, HUB_PREFIX, TEXT_SUFFIXES, PromptDataError, Row,
                          builtin_datasets, config_files, config_problem, config_read, data_files, iter_rows,
                          readme_configs, resolve_prompt_path, sample_rows, sniff_file, text_file_problem, text_shards)

__all__ = ["Prompt", "PromptSet", "Rejection", "PromptDataError", "load_prompts", "load_datasets",
           "check_source", "ROLES", "BUILTIN_PREFIX", "HUB_PREFIX", "TEXT_SUFFIXES", "COLUMNAR_SUFFIXES",
           "builtin_datasets", "resolve_prompt_path", "iter_rows"]


@dataclass
class Prompt:
    """One prompt: its dataset, id, chat messages and optional OpenAI-format tools.

    `conversation` is every turn of the source row (None: the same as `messages`); `meta`
    holds card fields kept and `reference_reply`, the dataset's own last reply.
    """

    dataset: str
    sample_id: int | str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    conversation: list[dict[str, Any]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def as_row(self) -> dict[str, Any]:
        """The prompt as a `format: prompts` line (what `prompts --out` writes)."""
        row: dict[str, Any] = {"sample_id": self.sample_id, "messages": self.messages}
        if self.tools:
            row["tools"] = self.tools
        if self.conversation is not None and self.conversation != self.messages:
            row["conversation"] = self.conversation
        if self.meta:
            row["meta"] = self.meta
        return row


@dataclass
class Rejection:
    """A row the loader did not keep: where it is, and why."""

    where: str
    reason: str
    duplicate: bool = False

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"

    @property
    def kind(self) -> str:
        """The reason without its particulars (for counting rejections by reason)."""
        k = re.sub(r"\s*\([^()]*\)\s*$", "", self.reason)
        k = re.sub(r"'[^']*'|\"[^\"]*\"", "…", k)
        return re.sub(r"(?<!UTF-)(?<!Windows-)(?<!\d)\d+", "N", k)


@dataclass
class PromptSet:
    """Prompts of one dataset, plus the rows the loader rejected (`file:line: reason`)."""

    dataset: str
    path: Path
    prompts: list[Prompt] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    format: str = "prompts"
    rows: int = 0
    config: str | None = None  # the config of a dataset folder whose README names configs (`subset`, else its default)
    configs: list[str] = field(default_factory=list)  # every config that README names
    default_config: bool = False  # `config` is the folder's default, read because `subset` is unset

    @property
    def config_note(self) -> str:
        """Which config was read, where the folder has several: named, and whether it was the default."""
        if len(self.configs) < 2 or self.config is None:
            return ""
        how = "its default config, as `datasets` reads it; set `subset` for another" if self.default_config \
            else "set by `subset`"
        return f"config {self.config!r} of {', '.join(self.configs)} ({how})"

    @property
    def skipped(self) -> list[str]:
        """Every rejected row as `location: reason` (malformed rows and duplicates)."""
        return [str(r) for r in self.rejected]

    @property
    def duplicates(self) -> int:
        return sum(r.duplicate for r in self.rejected)

    @property
    def malformed(self) -> int:
        return len(self.rejected) - self.duplicates

    @property
    def rejected_share(self) -> float:
        """Malformed rows over rows read (exact duplicates are not bad input: not counted)."""
        return self.malformed / self.rows if self.rows else 0.0

    def reason_counts(self) -> list[tuple[str, int, str]]:
        """(reason, count, first location) per kind of rejection, most frequent first."""
        first: dict[str, str] = {}
        counts: Counter[str] = Counter()
        for r in self.rejected:
            counts[r.kind] += 1
            first.setdefault(r.kind, r.where)
        return [(k, n, first[k]) for k, n in counts.most_common()]

    def summary(self, examples: int = 3) -> list[str]:
        """A few lines for the terminal: counts, then the first rejections with their reasons."""
        dup = f", {self.duplicates} exact duplicate{'s' * (self.duplicates != 1)} dropped" if self.duplicates else ""
        lines = [f"prompts {self.dataset}: {self.malformed} of {self.rows} rows rejected "
                 f"({self.rejected_share:.0%}){dup}; {len(self.prompts)} prompts from {self.path} "
                 f"(format {self.format}" + (f", {self.config_note}" if self.config_note else "") + ")"]
        for kind, n, where in self.reason_counts()[:examples]:
            lines.append(f"  {n:>6} x {kind}   (first: {where})")
        for r in self.rejected[:examples]:
            lines.append(f"  {r}")
        return lines


# ---------------------------------------------------------------- rows -> prompts


def content_id(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """A stable id from the prompt's content: 16 hex digits of SHA-256 over messages and tools."""
    try:
        blob = orjson.dumps({"messages": messages, "tools": tools or None}, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        blob = json.dumps({"messages": messages, "tools": tools or None}, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def row_to_prompt(fmt: DatasetFormat, row: dict[str, Any], dataset: str) -> Prompt:
    """One published row as a Prompt; raises RowError with the reason."""
    n = fmt.normalize(row)
    conv = n.conversation
    msgs = list(conv if n.messages is None else n.messages)
    meta = dict(n.meta)
    if fmt.drop_trailing_reply and msgs and msgs[-1]["role"] == "assistant":
        last = msgs.pop()
        meta["reference_reply"] = last["content"]
        if last.get("tool_calls"):
            meta["reference_tool_calls"] = last["tool_calls"]
    if not any(m["role"] == "user" for m in msgs):
        raise RowError("has no user turn" + (" before the assistant reply" if conv else ""))
    if msgs[-1]["role"] not in ("user", "tool"):
        raise RowError(f"the prompt must end with a user or tool turn, ends with {msgs[-1]['role']!r}"
                       + (" after the last assistant reply is cut off" if fmt.drop_trailing_reply else ""))
    sid = n.row_id if n.row_id is not None else content_id(msgs, n.tools)
    return Prompt(dataset, sid, msgs, n.tools, conv if conv != msgs else None, meta)


def load_prompts(path: str | Path, dataset: str | None = None, format: str = "prompts", *,
                 split: str | None = None, subset: str | None = None) -> PromptSet:
    """Load one prompt dataset; bad rows are skipped and reported as `location: reason`.

    Raises PromptDataError when the source itself cannot be read (missing file, a JSON
    array that does not parse, a parquet file `datasets` cannot open).
    """
    fmt = get_format(format)
    src = str(path)
    p = Path(src) if src.startswith(HUB_PREFIX) else resolve_prompt_path(src)
    name = dataset or (p.stem if not src.startswith(HUB_PREFIX) else src.split("/")[-1])
    out = PromptSet(dataset=name, path=p, format=fmt.name)
    if not src.startswith(HUB_PREFIX) and p.is_dir():
        out.configs = readme_configs(p)[0]
        out.config = config_read(p, subset) if out.configs else None
        out.default_config = subset is None and out.config is not None
    seen_ids: dict[str, tuple[str, str]] = {}  # sample_id -> (content id, short location)
    seen_content: dict[str, tuple[Any, str]] = {}  # content id -> (sample_id, short location)
    for where, short, row in iter_rows(src, split=split, subset=subset):
        out.rows += 1
        if isinstance(row, RowError):
            out.rejected.append(Rejection(where, str(row)))
            continue
        try:
            prompt = row_to_prompt(fmt, row, name)
        except RowError as e:
            out.rejected.append(Rejection(where, str(e)))
            continue
        cid = content_id(prompt.messages, prompt.tools) if fmt.id_field else str(prompt.sample_id)
        sid = str(prompt.sample_id)
        if sid in seen_ids and fmt.id_field:
            first_cid, first_at = seen_ids[sid]
            out.rejected.append(Rejection(where, f"duplicate sample_id {prompt.sample_id!r} (first on {first_at})",
                                          duplicate=first_cid == cid))
            continue
        if cid in seen_content:
            first_sid, first_at = seen_content[cid]
            out.rejected.append(Rejection(where, f"duplicate prompt: the same messages and tools as sample_id "
                                                 f"{first_sid!r} (first on {first_at})", duplicate=True))
            continue
        seen_ids[sid] = (cid, short)
        seen_content[cid] = (prompt.sample_id, short)
        out.prompts.append(prompt)
    return out


def load_datasets(params: Any) -> dict[str, PromptSet]:
    """Prompt sets of a run, each shuffled with the run's seed and cut to its `limit`."""
    sets: dict[str, PromptSet] = {}
    seed = params.generate.sampling.seed
    for d in params.datasets:
        ps = load_prompts(d.path, d.name, getattr(d, "format", "prompts"), split=getattr(d, "split", None),
                          subset=getattr(d, "subset", None))
        rng = random.Random(f"{seed}:{d.name}")
        rng.shuffle(ps.prompts)
        if d.limit is not None:
            ps.prompts = ps.prompts[: d.limit]
        sets[d.name] = ps
    return sets


# ---------------------------------------------------------------- checking a source before any work


def _looks_like(fmt: DatasetFormat, rows: list[dict[str, Any]]) -> list[str]:
    """Other registered formats that make prompts of these rows."""
    return accepting_formats(rows, exclude=fmt.name, reads=lambda f, r: row_to_prompt(f, r, ""))


def _rows_problem(p: Path, fmt: DatasetFormat, rows: list[Row], whole: bool, all_bad: bool) -> str | None:
    """Why the first rows of a file say it cannot be read as `fmt`: none has the format's fields (a wrong
    format), or (`all_bad`) none makes a prompt; with the formats the rows look like."""
    dicts = [r for _, _, r in rows if isinstance(r, dict)]
    if dicts and all(fmt.missing_fields(set(r)) for r in dicts):
        guess = _looks_like(fmt, dicts) or guess_formats(set(dicts[0]))
        hint = f"; it looks like format {' or '.join(guess)}" if guess else ""
        return f"{p}: the first rows are not format `{fmt.name}`: {fmt.missing_fields(set(dicts[0]))}{hint}"
    if not all_bad:
        return None
    if not rows:
        return f"{p}: holds no rows (only blank lines, or an empty array)" if whole else None
    first = None
    for where, _, row in rows:
        if isinstance(row, RowError):
            first = first or f"{where}: {row}"
            continue
        try:
            row_to_prompt(fmt, row, "")
            return None
        except RowError as e:
            first = first or f"{where}: {e}"
    guess = _looks_like(fmt, dicts) if dicts else []
    hint = f"; it looks like format {' or '.join(guess)}" if guess else ""
    scope = "its one row is" if len(rows) == 1 and whole else f"all {len(rows)} rows are" if whole \
        else f"the first {len(rows)} rows are all"
    return f"{p}: {scope} rejected as format `{fmt.name}` (first: {first}){hint}"


def _file_problem(p: Path, fmt: DatasetFormat, all_bad: bool) -> str | None:
    sniff = sniff_file(p)
    suffix = p.suffix.lower()
    if sniff == "empty":
        return f"{p}: the file is empty (no rows)"
    if suffix == ".parquet" and sniff != "parquet":
        return f"{p}: is not a parquet file (no PAR1 magic; a {sniff} file?)"
    if suffix in COLUMNAR_SUFFIXES or (sniff in ("parquet", "arrow") and suffix not in TEXT_SUFFIXES):
        if sniff != "parquet":
            return None
        try:
            import pyarrow.parquet as pq

            keys = set(pq.read_schema(p).names)
        except Exception as e:
            return f"{p}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        if fmt.missing_fields(keys):
            guess = guess_formats(keys)
            hint = f"; it looks like format {' or '.join(guess)}" if guess else ""
            return f"{p}: the first rows are not format `{fmt.name}`: {fmt.missing_fields(keys)}{hint}"
        return None
    why = text_file_problem(p, sniff)
    if why:
        return why
    return _rows_problem(p, fmt, *sample_rows([p]), all_bad)


def check_source(path: str, format: str = "prompts", *, split: str | None = None, subset: str | None = None,
                 all_bad: bool = True) -> str | None:
    """Why a prompt source cannot be read by its format (one line naming the file), or None.

    Bounded: it sniffs the first bytes of each file and reads the first rows of JSON text (up to
    `promptfiles.SAMPLE_ROWS` rows, about 1 MiB a file; a `.json` array's last bytes too), or
    a parquet schema: a file in another encoding, a `.json` array cut off, rows that are all of
    another format and (`all_bad`) rows none of which makes a prompt are named before any
    work; a dataset folder with several configs, none its default, and no `subset` lists its configs. `hf:`
    names are not checked here (they need the hub).
    """
    fmt = get_format(format)
    if path.startswith(HUB_PREFIX):
        return None
    try:
        p = resolve_prompt_path(path)
    except FileNotFoundError as e:
        return str(e)
    if not p.exists():
        return f"prompt file not found: {p}"
    try:
        if not p.is_dir():
            return _file_problem(p, fmt, all_bad)
        files = data_files(p)
        if not files:
            return f"{p}: the folder holds no .jsonl, .json, .parquet or .arrow files"
        shards = text_shards(p, split, subset)
        if shards:
            return _rows_problem(p, fmt, *sample_rows(shards), all_bad)
        config = config_read(p, subset)
        return config_problem(p, subset) or _file_problem((config_files(p, config) if config else files)[0], fmt, all_bad)
    except PromptDataError as e:
        return str(e)


def tools_as_system_text(tools: list[dict[str, Any]]) -> str:
    """Tool definitions as glaive-style system-prompt text, for templates without tools."""
    lines = ["You have access to the following functions. To call one, answer with JSON "
             '{"name": <function name>, "arguments": <arguments object>}.']
    for t in tools:
        lines.append(json.dumps(t.get("function", t), ensure_ascii=False, indent=2))
    return "\n".join(lines)


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def messages_for_template(prompt: Prompt, profile: Profile) -> tuple[list[dict[str, Any]], list | None]:
    """Messages and tools as the chat template takes them for this profile."""
    msgs = [dict(m) for m in prompt.messages]
    if profile.template_supports_tools:
        return msgs, prompt.tools
    for m in msgs:  # the template renders only `content`: earlier tool calls go in as the JSON it asks for
        if m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])},
                                ensure_ascii=False) for c in m.pop("tool_calls")]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + calls)
    if not prompt.tools:
        return msgs, prompt.tools
    tool_text = tools_as_system_text(prompt.tools)
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = msgs[0]["content"].rstrip() + "\n\n" + tool_text
    else:
        msgs.insert(0, {"role": "system", "content": tool_text})
    return msgs, None


def template_prompts(tokenizer: Any, prompts: Sequence[Prompt], profile: Profile) -> list[list[int]]:
    """Prompt ids of many prompts: the chat template with the generation prompt and the profile's options.

    Each prompt is rendered to text by the template, then all are encoded in one tokenizer call with
    `add_special_tokens=False`: what `apply_chat_template(tokenize=True)` does per prompt (it encodes
    its rendered text the same way), at about half the CPU per prompt for short prompts (the per-call
    overhead of the fast tokenizer's Python wrapper is paid once per batch)."""
    texts = []
    for prompt in prompts:
        msgs, tools = messages_for_template(prompt, profile)
        kwargs = dict(profile.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        texts.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kwargs))
    if not texts:
        return []
    return [[int(i) for i in ids] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def template_prompt(tokenizer: Any, prompt: Prompt, profile: Profile) -> list[int]:
    """Prompt ids of one prompt (`template_prompts` of one)."""
    return template_prompts(tokenizer, [prompt], profile)[0]


# ---------------------------------------------------------------- `python -m eagle3data prompts`


def _short(v: Any, n: int = 160) -> Any:
    """A message or value with long strings cut, for showing examples in a terminal."""
    if isinstance(v, str):
        return v if len(v) <= n else v[:n] + f"… ({len(v)} chars)"
    if isinstance(v, list):
        return [_short(x, n) for x in v]
    if isinstance(v, dict):
        return {k: _short(x, n) for k, x in v.items()}
    return v


def prompts_cli(path: str, format: str, *, split: str | None = None, subset: str | None = None,
                show: int = 3, rejected: int = 20, out: str | None = None) -> int:
    """What a file turns into: counts, rejections by reason with their location, examples; `out` writes
    the normalized prompts as `format: prompts` JSONL. Exit status 0 with usable prompts, 1 with none;
    a file that cannot be read at all raises PromptDataError (`cli.main`: one line on stderr, exit 2)."""
    try:
        get_format(format)
    except KeyError as e:
        raise PromptDataError(e.args[0]) from None
    why = check_source(path, format, split=split, subset=subset, all_bad=False)  # all-bad rows: listed below
    if why:
        raise PromptDataError(why)
    try:
        ps = load_prompts(path, format=format, split=split, subset=subset)
    except FileNotFoundError as e:  # an unknown builtin: name
        raise PromptDataError(str(e)) from None
    turns = Counter(len(p.conversation or p.messages) for p in ps.prompts)
    replies = sum("reference_reply" in p.meta for p in ps.prompts)
    with_tools = sum(bool(p.tools) for p in ps.prompts)
    print(f"{ps.path} (format {ps.format}" + (f", {ps.config_note}" if ps.config_note else "")
          + f"): {ps.rows} rows -> {len(ps.prompts)} prompts; "
          f"{ps.malformed} rejected ({ps.rejected_share:.1%}), {ps.duplicates} exact duplicates dropped")
    print(f"  prompts with tools: {with_tools}; trailing assistant reply cut off (kept as meta.reference_reply): "
          f"{replies}; turns per row: {dict(sorted(turns.items())[:12])}")
    if ps.rejected:
        print("rejected, by reason:")
        for kind, n, where in ps.reason_counts():
            print(f"  {n:>7}  {kind}   (first: {where})")
        print(f"first {min(rejected, len(ps.rejected))} rejected rows:")
        for r in ps.rejected[:rejected]:
            print(f"  {r}")
    for p in ps.prompts[:show]:
        tools = ", ".join(t["function"]["name"] for t in p.tools or [])
        print(f"example sample_id {p.sample_id!r}" + (f" (tools: {tools})" if tools else "") + ":")
        for m in p.messages:
            extra = {k: v for k, v in m.items() if k not in ("role", "content")}
            print(f"  {m['role']:>9}: {json.dumps(_short(m['content'], 120), ensure_ascii=False)}"
                  + (f" {json.dumps(_short(extra, 80), ensure_ascii=False)}" if extra else ""))
        if p.meta:
            print(f"  {'meta':>9}: {json.dumps(_short(p.meta, 80), ensure_ascii=False)}")
    if out:
        dst = Path(out)
        dst.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(dst) as tmp, open(tmp, "wb") as f:
            for p in ps.prompts:
                f.write(orjson.dumps(p.as_row()) + b"\n")
        print(f"wrote {len(ps.prompts)} prompts to {dst} (read it back with format: prompts)")
    return 0 if ps.prompts else 1


def check_dataset_files(params: Any) -> None:
    """Every prompt dataset exists and its first rows read as its format (`check_source`, bounded);
    else ParamsError naming every bad dataset at once, one line each.

    Run before any work starts (01 calls it first). Not part of `load_params`: a params file
    is valid on a machine that does not hold its datasets.
    """
    bad = []
    for i, d in enumerate(params.datasets):
        why = check_source(d.path, d.format, split=d.split, subset=d.subset)
        if why:
            bad.append(f"datasets.{i} ({d.name}, format {d.format}): {why}")
    if bad:
        raise ParamsError("\n".join(bad))
