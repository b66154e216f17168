"""Prompt files as bytes: what a file is, and its rows with their locations (`prompts.py` turns rows into prompts).

What a file is comes from its first 64 KiB (`sniff_file`): parquet/arrow/gzip/zip magic, UTF-16 or
UTF-32 text (with or without a byte-order mark), Windows-1252 (or Latin-1) text (more than
half of its lines are not UTF-8, and no line is UTF-8 beyond ASCII), a binary file (NUL or
control bytes), or UTF-8 text. A UTF-8 file with a few lines that are not UTF-8 is text: each such line is
rejected as a row by `file:line` ("not UTF-8 (looks like Windows-1252): re-save the file as
UTF-8") and the others load, wherever the line is. A file in another encoding is refused
as a whole, in one line that names the file, the encoding and the fix.

`.jsonl` is read line by line; a `.json` array element by element (a row holding bytes that
are not UTF-8 is rejected alone; an array that ends before it is closed is "cut off"). With
`sample=True` only the first `SAMPLE_ROWS` rows or `SAMPLE_BYTES` are read (the run's
preflight). Parquet, arrow, dataset folders and `hf:` names go through the HF `datasets`
library; a dataset folder whose README names several configs is read with `subset`, else with its
default config as `datasets` picks it (flagged `default: true`, or named `default`); with none of
them it is refused, naming the configs it has.
"""

from __future__ import annotations

import ast
import codecs
import json
import re
from importlib import resources
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import yaml

from eagle3data.core.errors import UserInputError
from eagle3data.prompts.formats import RowError
from eagle3data.core.params import repo_root

BUILTIN_PREFIX = "builtin:"
HUB_PREFIX = "hf:"
TEXT_SUFFIXES = (".jsonl", ".json", ".ndjson")
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
SNIFF_BYTES = 65536
SAMPLE_ROWS = 200  # what the preflight reads of each file: this many rows, or
SAMPLE_BYTES = 1 << 20  # this many bytes (at least one row; a .json array's first element may need more)
_SAMPLE_BYTES_MAX = 64 << 20

Row = tuple[str, str, "dict[str, Any] | RowError"]  # (location, short location, row or why not)

_CONTROL = bytes([*range(0, 9), 11, *range(14, 32), 127])  # no tab, newline, form feed, carriage return
_WS = re.compile(r"[ \t\n\r]*")
_ESCAPED = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as `surrogateescape` decodes it
_CUT = "the file is cut off (truncated: a partial download?)"


class PromptDataError(UserInputError, ValueError):
    """A prompt dataset cannot be used (missing, unreadable, nothing usable, too much rejected)."""


def builtin_datasets() -> list[str]:
    """Names of the prompt sets shipped with the package."""
    root = resources.files("eagle3data") / "data" / "prompts"
    return sorted(p.name[: -len(".jsonl")] for p in root.iterdir() if p.name.endswith(".jsonl"))


def resolve_prompt_path(path: str) -> Path:
    """`builtin:NAME` -> the shipped file; a relative path not found here -> under the repository root."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        p = Path(str(resources.files("eagle3data") / "data" / "prompts" / f"{name}.jsonl"))
        if not p.exists():
            raise FileNotFoundError(f"no builtin prompt set {name!r}; known: {', '.join(builtin_datasets())}")
        return p
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists():
        alt = repo_root() / p
        if alt.exists():
            return alt
    return p


# ---------------------------------------------------------------- what a file is


def _utf16_without_bom(head: bytes) -> bool:
    """UTF-16 text without a byte-order mark: NUL in every other byte (ASCII-range text), and it decodes."""
    h = head[: len(head) // 2 * 2]
    half = len(h) // 2
    if half < 2:
        return False
    even, odd = h[0::2].count(0), h[1::2].count(0)
    enc = "utf-16-le" if odd > 0.3 * half and even < 0.02 * half else \
        "utf-16-be" if even > 0.3 * half and odd < 0.02 * half else None
    if enc is None:
        return False
    try:
        text = codecs.getincrementaldecoder(enc)().decode(h, final=False)
    except UnicodeDecodeError:
        return False
    return sum(c.isprintable() or c in "\t\n\r" for c in text) >= 0.95 * len(text)


def sniff_file(p: Path) -> str:
    """What the first bytes of a file say it is: parquet, arrow, gzip, zip, empty, text (UTF-8; a few lines
    that are not UTF-8 allowed), utf-16, utf-32, cp1252 (Windows-1252 or Latin-1 text), or binary."""
    with open(p, "rb") as f:
        head = f.read(SNIFF_BYTES)
        more = bool(f.read(1))
    if not head:
        return "empty"
    if head[:4] == b"PAR1":
        return "parquet"
    if head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff":
        return "arrow"
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:2] == b"PK":
        return "zip"
    if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return "utf-32"
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or _utf16_without_bom(head):
        return "utf-16"
    if head.count(0) > len(head) // 100:
        return "binary"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        return "text"
    except UnicodeDecodeError:
        pass
    if len(head) - len(head.translate(None, _CONTROL)) > len(head) // 100:
        return "binary"
    lines = head.split(b"\n")
    n = bad = utf8 = 0
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        n += 1
        if line.isascii():
            continue
        try:  # the last line may be cut by the 64 KiB: judged by the bytes read
            codecs.getincrementaldecoder("utf-8")().decode(line, final=not (more and k == len(lines) - 1))
            utf8 += 1
        except UnicodeDecodeError:
            bad += 1
    return "cp1252" if utf8 == 0 and 2 * bad > n else "text"  # mostly 8-bit lines, none UTF-8 beyond ASCII


def text_file_problem(p: Path, sniff: str) -> str | None:
    """Why a file read as JSON text is not UTF-8 JSON text (one line: the file, what it is, the fix), or None."""
    if sniff in ("text", "empty"):
        return None
    if sniff in ("utf-16", "utf-32"):
        return f"{p}: is {sniff.upper()} text, not UTF-8: re-save it as UTF-8 (e.g. `iconv -f {sniff} -t utf-8`)"
    if sniff == "cp1252":
        return (f"{p}: is Windows-1252 (or Latin-1) text, not UTF-8: re-save it as UTF-8 "
                "(e.g. `iconv -f cp1252 -t utf-8`)")
    if p.suffix.lower() in TEXT_SUFFIXES:
        hint = f" (rename it to .{sniff})" if sniff in ("parquet", "arrow") else ""
        return f"{p}: is a {sniff} file, not JSON text{hint}"
    if sniff in ("gzip", "zip", "binary"):
        return f"{p}: is a {sniff} file; prompt files are .jsonl, .json, .parquet or .arrow"
    return None


def _not_utf8(raw: bytes, start: int, unit: str) -> RowError:
    """A line (or array row) whose bytes are not UTF-8: rejected alone, with the likely encoding and the fix."""
    try:
        raw.decode("cp1252")
        looks = " (looks like Windows-1252)"
    except UnicodeDecodeError:
        looks = ""
    return RowError(f"not UTF-8{looks}: re-save the file as UTF-8 (byte {start} of the {unit})")


# ---------------------------------------------------------------- JSON text


def _bare(msg: str) -> str:
    """A `json` error message without its trailing "at" (`Unterminated string starting at`), to add our own."""
    return re.sub(r"\s+at$", "", msg)


def _ends_inside(e: json.JSONDecodeError, text: str) -> bool:
    """The text ends inside a JSON value (a string, a literal, before a closing bracket): it is cut off."""
    rest = text[e.pos:].rstrip()
    return e.msg.startswith("Unterminated string") or not rest or any(w.startswith(rest) for w in
                                                                     ("true", "false", "null"))


def _json_error(e: json.JSONDecodeError, text: str) -> str:
    """Why a JSON line does not parse; a line that ends inside a value "is cut off"."""
    if _ends_inside(e, text):
        return (f"not valid JSON: the line is cut off (it ends at column {len(text)} before the JSON value is "
                "closed: a write stopped half-way, or the file was cut)")
    if e.msg == "Extra data":
        return f"not valid JSON: more than one JSON value on the line (column {e.colno}; a lost newline?)"
    return f"not valid JSON ({_bare(e.msg)} at column {e.colno})"


def _line_col(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"line {line} column {pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"


def _cut_off(p: Path, text: str, why: str = "", what: str = "array") -> PromptDataError:
    end = len(text.rstrip())
    return PromptDataError(f"{p}: {_CUT}: the JSON ends at {_line_col(text, end)} before the {what} is closed"
                           + (f" ({why})" if why else ""))


def _json_file_error(p: Path, e: json.JSONDecodeError, text: str, what: str = "array") -> PromptDataError:
    """A `.json` file that does not parse: cut off (it ends inside a value), or where it goes wrong."""
    if _ends_inside(e, text):
        return _cut_off(p, text, f"{_bare(e.msg)} at line {e.lineno} column {e.colno}", what)
    return PromptDataError(f"{p}: not valid JSON ({_bare(e.msg)} at line {e.lineno} column {e.colno})")


def _cut_at_end(e: json.JSONDecodeError, text: str) -> bool:
    """The value was cut where the text read ends (not a mistake inside it)."""
    return e.msg.startswith("Unterminated string") or e.pos >= len(text) - 8


def _jsonl_row(p: Path, lineno: int, raw: bytes) -> Row | None:
    where, short = f"{p}:{lineno}", f"line {lineno}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return where, short, _not_utf8(raw, e.start, "line")
    text = line.rstrip("\r\n")
    if lineno == 1:
        text = text.lstrip("\ufeff")
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return where, short, RowError(_json_error(e, text))
    return where, short, obj if isinstance(obj, dict) else RowError("line is not a JSON object")


def _iter_jsonl(p: Path, max_bytes: int | None = None) -> Iterator[Row]:
    """Rows of JSON lines; `max_bytes`: stop after the line that reaches that many bytes."""
    read = 0
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            row = _jsonl_row(p, lineno, raw)
            if row is not None:
                yield row
            read += len(raw)
            if max_bytes is not None and read >= max_bytes and row is not None:
                return


def _array_row(p: Path, i: int, text: str, pos: int, end: int, obj: Any) -> Row:
    where, short = f"{p} row {i}", f"row {i}"
    bad = _ESCAPED.search(text, pos, end)
    if bad:
        return where, short, _not_utf8(text[pos:end].encode("utf-8", "surrogateescape"),
                                       len(text[pos:bad.start()].encode("utf-8", "surrogateescape")), "row")
    return where, short, obj if isinstance(obj, dict) else RowError("row is not a JSON object")


def _iter_json_array(p: Path, text: str, pos: int, partial: bool) -> Iterator[Row]:
    """Rows of the JSON array that opens at `text[pos]`, element by element. `partial`: `text` is the
    file's first bytes, so a value cut where the text ends stops the rows quietly."""
    dec = json.JSONDecoder()
    pos = _WS.match(text, pos + 1).end()
    i = 0
    while not text.startswith("]", pos):
        if i:
            if pos >= len(text):
                if partial:
                    return
                raise _cut_off(p, text)
            if text[pos] != ",":
                raise PromptDataError(f"{p}: not valid JSON (Expecting ',' delimiter at {_line_col(text, pos)})")
            pos = _WS.match(text, pos + 1).end()
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if partial and _cut_at_end(e, text):
                return
            raise _json_file_error(p, e, text) from None
        i += 1
        yield _array_row(p, i, text, pos, end, obj)
        pos = _WS.match(text, end).end()
    pos = _WS.match(text, pos + 1).end()
    if pos < len(text) and not partial:
        raise PromptDataError(f"{p}: not valid JSON (more text after the array ends, at {_line_col(text, pos)})")


def _iter_json(p: Path, sample: bool) -> Iterator[Row]:
    """`.json`: a JSON array of rows, one JSON object, or JSON lines under a .json name. `sample`: the
    first `SAMPLE_BYTES` (more where the first row is longer), and the last bytes (is the array closed?)."""
    size = p.stat().st_size
    n = min(SAMPLE_BYTES, size) if sample else size
    while True:
        with open(p, "rb") as f:
            head = f.read(n)
        text = head.decode("utf-8", "surrogateescape").lstrip("\ufeff")
        partial = len(head) < size
        start = _WS.match(text).end()
        if start >= len(text) and not partial:
            raise PromptDataError(f"{p}: the file is empty (only whitespace, no rows)")
        if text.startswith("[", start):
            if partial:
                with open(p, "rb") as f:
                    f.seek(max(0, size - 64))
                    if not f.read().rstrip().endswith(b"]"):
                        raise PromptDataError(f"{p}: {_CUT}: it ends at byte {size} before the JSON array is closed")
            rows = _iter_json_array(p, text, start, partial)
            first = next(rows, None)
            if first is None and partial and n < _SAMPLE_BYTES_MAX:
                n *= 4  # the first row is longer than what was read
                continue
            if first is not None:
                yield first
                yield from rows
            return
        try:
            obj, end = json.JSONDecoder().raw_decode(text, start)
        except json.JSONDecodeError as e:
            if partial and _cut_at_end(e, text):
                if n < _SAMPLE_BYTES_MAX:
                    n *= 4
                    continue
                return
            raise _json_file_error(p, e, text, "value") from None
        break
    if partial or _WS.match(text, end).end() < len(text):  # more values: JSON lines under a .json name
        yield from _iter_jsonl(p, SAMPLE_BYTES if sample else None)
        return
    if not isinstance(obj, dict):
        raise PromptDataError(f"{p}: holds a JSON {type(obj).__name__}, not a list of rows")
    yield _array_row(p, 1, text, start, end, obj)


def _iter_text(p: Path, sample: bool = False) -> Iterator[Row]:
    """JSON text (`.jsonl`, `.json`, anything else read as JSON lines); refused as a whole when it is not
    UTF-8 text. `sample`: the first `SAMPLE_ROWS` rows or `SAMPLE_BYTES` only."""
    why = text_file_problem(p, sniff_file(p))
    if why:
        raise PromptDataError(why)
    rows = _iter_json(p, sample) if p.suffix.lower() == ".json" else _iter_jsonl(p, SAMPLE_BYTES if sample else None)
    yield from islice(rows, SAMPLE_ROWS) if sample else rows


# ---------------------------------------------------------------- datasets library


def _readme_meta_configs(folder: Path) -> list[dict[str, Any]]:
    f = folder / "README.md"
    if not f.is_file():
        return []
    m = re.match(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|\Z)", f.read_text("utf-8", errors="replace"), re.S)
    try:
        meta = yaml.safe_load(m.group(1)) if m else None
    except yaml.YAMLError:
        return []
    configs = meta.get("configs") if isinstance(meta, dict) else None
    return [c for c in configs or [] if isinstance(c, dict) and isinstance(c.get("config_name"), str)] \
        if isinstance(configs, list) else []


def readme_configs(folder: Path) -> tuple[list[str], str | None]:
    """Config names in a downloaded dataset repository's README front-matter (`configs:`), and the default.

    The default is the `datasets` library's (`MetadataConfigs.get_default_config_name`): the config
    flagged `default: true`, the one named `default`, or the only one; None where no config or
    more than one qualifies (`datasets` then needs a name too)."""
    configs = _readme_meta_configs(folder)
    names = [c["config_name"] for c in configs]
    cands = [c["config_name"] for c in configs if len(configs) == 1 or c["config_name"] == "default" or c.get("default")]
    return names, cands[0] if len(cands) == 1 else None


def config_files(folder: Path, name: str) -> list[Path]:
    """The files a README config names in its `data_files` (globs from the folder), else every data file."""
    conf = next((c for c in _readme_meta_configs(folder) if c["config_name"] == name), {})
    spec = conf.get("data_files")
    entries = spec if isinstance(spec, list) else [spec] if spec else []
    pats = [x for e in entries for x in ((e.get("path"),) if isinstance(e, dict) else (e,))]
    pats = [x for p in pats for x in (p if isinstance(p, list) else [p]) if isinstance(x, str)]
    files = sorted({f for pat in pats for f in folder.glob(pat) if f.is_file()})
    return files or data_files(folder)


def config_read(folder: Path, subset: str | None) -> str | None:
    """The config a dataset folder is read with: `subset`, else its README's default where the README
    names configs (what `datasets.load_dataset` reads with no name), else None (no configs)."""
    if subset is not None:
        return subset
    names, default = readme_configs(folder)
    return default if names else None


def _configs_problem(label: str, names: list[str], subset: str | None) -> str:
    which = f"no config {subset!r}" if subset else f"{len(names) or 'several'} configs and no `subset` is set"
    pick = f" to one of {', '.join(names)}" if names else " (see the configs in its README)"
    return f"{label}: the dataset has {which}: set the dataset's `subset` param{pick}"


def config_problem(folder: Path, subset: str | None) -> str | None:
    """A dataset folder with several configs, none of them its default (flagged, or named `default`),
    and no `subset`; or a `subset` it does not have. From its README."""
    names, default = readme_configs(folder)
    if subset is None and len(names) > 1 and default is None or subset is not None and names and subset not in names:
        return _configs_problem(str(folder), names, subset)
    return None


def _hf_configs_error(text: str, source: str, label: str, subset: str | None) -> str | None:
    """The `datasets` error for a missing or unknown config, as a line listing the configs to pick from."""
    if "Config name is missing" not in text and not ("BuilderConfig" in text and "not found" in text):
        return None
    names = readme_configs(Path(source))[0] if Path(source).is_dir() else []
    if not names:
        m = re.search(r"\[[^\[\]]*\]", text)
        try:
            names = [str(x) for x in ast.literal_eval(m.group(0))] if m else []
        except (ValueError, SyntaxError):
            names = []
    return _configs_problem(label, names, subset)


def _iter_hf(source: str, label: str, *, builder: str | None = None, split: str | None = None,
             subset: str | None = None) -> Iterator[Row]:
    """Rows through the HF `datasets` library, streamed (nothing is copied into its cache)."""
    try:
        import datasets
    except ImportError:
        raise PromptDataError(f"{label}: reading it needs the `datasets` package (pip install datasets)") from None
    try:
        if builder:
            ds = datasets.load_dataset(builder, data_files=source, split="train", streaming=True)
        else:
            ds = datasets.load_dataset(source, subset, split=split or "train", streaming=True)
        for i, row in enumerate(ds, start=1):
            yield f"{label} row {i}", f"row {i}", row
    except PromptDataError:
        raise
    except Exception as e:  # datasets raises many kinds; one line naming the file is what a user needs
        configs = _hf_configs_error(str(e), source, label, subset)
        if configs:
            raise PromptDataError(configs) from None
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise PromptDataError(f"{label}: cannot be read by the `datasets` library ({type(e).__name__}: {msg})") from None


# ---------------------------------------------------------------- files and folders


def data_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES + COLUMNAR_SUFFIXES
                  and not any(part.startswith(".") for part in f.relative_to(folder).parts))


def _file_kind(p: Path) -> str:
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".arrow":
        return "arrow"
    if suffix in TEXT_SUFFIXES:
        return "text"
    sniff = sniff_file(p)
    return sniff if sniff in ("parquet", "arrow") else "text"


def text_shards(p: Path, split: str | None, subset: str | None) -> list[Path] | None:
    """The files of a folder read here, file by file (only JSON text, no split or subset, no README configs:
    a config names its own files), else None."""
    files = data_files(p)
    if split is None and subset is None and files and all(f.suffix.lower() in TEXT_SUFFIXES for f in files) \
            and not readme_configs(p)[0]:
        return files
    return None


def iter_rows(path: str, *, split: str | None = None, subset: str | None = None) -> Iterator[Row]:
    """Every row of a prompt source as (location, short location, row or RowError)."""
    if path.startswith(HUB_PREFIX):
        yield from _iter_hf(path[len(HUB_PREFIX):], path, split=split, subset=subset)
        return
    p = resolve_prompt_path(path)
    if not p.exists():
        raise PromptDataError(f"prompt file not found: {p}")
    if p.is_dir():
        shards = text_shards(p, split, subset)
        if shards:
            for f in shards:
                yield from _iter_text(f)
        else:
            yield from _iter_hf(str(p), str(p), split=split, subset=config_read(p, subset))
        return
    kind = _file_kind(p)
    if kind in ("parquet", "arrow"):
        yield from _iter_hf(str(p), str(p), builder=kind)
    else:
        yield from _iter_text(p)


def sample_rows(files: list[Path]) -> tuple[list[Row], bool]:
    """The first rows of JSON text files, in order (what the preflight checks: up to `SAMPLE_ROWS` rows,
    about `SAMPLE_BYTES` of each file read), and whether they are all the files hold. Every file is
    sniffed; raises PromptDataError for one that is not UTF-8 JSON text, or a `.json` array cut off."""
    rows: list[Row] = []
    whole = True
    for f in files:
        if len(rows) >= SAMPLE_ROWS:
            why = text_file_problem(f, sniff_file(f))
            if why:
                raise PromptDataError(why)
            whole = False
            continue
        got = list(_iter_text(f, sample=True))
        if len(got) >= SAMPLE_ROWS or f.stat().st_size > SAMPLE_BYTES or len(rows) + len(got) > SAMPLE_ROWS:
            whole = False
        rows.extend(got[: SAMPLE_ROWS - len(rows)])
    return rows, whole
