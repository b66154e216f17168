"""Write the `builtin:v1_stdlib_tasks` prompt set (stage 06's embedded default): coding and explanation
prompts about Python's own standard library, one per public function or class, made for this project.

Why these: `make value` needs thousands of prompts a fresh machine has without a dataset hub, of the
kind the held-out benchmark (HumanEval) asks about (short Python). The standard library's public
names with a docstring are such a source, on every machine, and none of them is a HumanEval problem
(the leak check of 06 proves it by text). The file is committed; this script is how it was made
(`python tools/make_value_prompts.py`, CPython 3.11: another version lists other names).

Each prompt carries the dataset's own reply in `meta.reference_reply` (never sent; records keep it), written
from the name's documentation (signature, docstring): the text 06's `dataset_replies` variant trains on in
place of the target's outputs (what a user who skips 01 trains on: replies another writer made, not the target).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import sys
import warnings
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "lib" / "eagle3data" / "data" / "prompts" / "v1_stdlib_tasks.jsonl"
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip", "venv",
        "pydoc_data", "test", "unittest.mock", "xxsubtype", "msilib", "winreg", "winsound", "_winapi", "nt"}
TEMPLATES = [
    "Write a short Python function that uses `{q}` (its documentation: \"{doc}\"). Show one example call and its output.",
    "Explain what `{q}{sig}` does, then give a small, complete Python example that uses it.",
    "Write a Python snippet that demonstrates `{q}` ({what}). Keep it under 15 lines and comment each step.",
    "I am new to Python's `{mod}` module. How do I use `{q}`? It says: \"{doc}\" Answer with code.",
]


def _first_line(obj) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if len(line) < 12 or len(line) > 200 or line.startswith(("Return", "Abstract")) and len(line) < 20:
        return None
    return line


def _reply(q: str, sig: str, obj) -> str:
    """The documentation's answer about `q`: its signature and up to three paragraphs of its docstring."""
    doc = inspect.getdoc(obj) or ""
    paras = [" ".join(x.split()) for x in doc.split("\n\n") if x.strip()][:3]
    body = "\n\n".join(paras)
    if len(body) > 1200:
        body = body[:1200].rsplit(" ", 1)[0] + " ..."
    return f"`{q}{sig}`\n\n{body}"


def _signature(obj) -> str:
    try:  # a default's repr may hold a memory address: dropped, so that every run writes the same file
        return re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"


def main() -> None:
    warnings.simplefilter("ignore")
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP)
    rows, seen = [], set()
    for mod_name in names:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - platform modules that do not import here
            continue
        public = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
        for name in sorted(set(public)):
            obj = getattr(mod, name, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            if (getattr(obj, "__module__", None) or mod_name).split(".")[0].lstrip("_") not in (mod_name, mod_name.lstrip("_")):
                continue  # re-exported from another module: asked about once, in its home
            doc = _first_line(obj)
            q = f"{mod_name}.{name}"
            if doc is None or q in seen:
                continue
            seen.add(q)
            what = doc[0].lower() + doc[1:].rstrip(".")
            pick = int(hashlib.sha256(q.encode()).hexdigest(), 16) % len(TEMPLATES)
            sig = _signature(obj)
            text = TEMPLATES[pick].format(q=q, sig=sig, what=what, doc=doc, mod=mod_name)
            rows.append({"sample_id": f"{mod_name}.{name}", "messages": [{"role": "user", "content": text}],
                         "meta": {"module": mod_name, "template": pick, "reference_reply": _reply(q, sig, obj)}})
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} prompts from {len({r['meta']['module'] for r in rows})} modules -> {OUT}")


if __name__ == "__main__":
    main()
