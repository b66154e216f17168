"""Prompt datasets: the files users have, their published formats, and the prompts 01 sends.

Owns reading files (`files`: JSONL/JSON/parquet/arrow/folders/builtin, encodings, bad rows by
file:line), the registry of dataset formats with a normalizer each (`formats`), and the prompt
set with its templating (`load`: `Prompt`, `load_prompts`, `template_prompts`, the preflight's
check of every dataset file). May import the core only.
"""
