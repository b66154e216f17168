"""What stops a stage from running at all, checked before any work: one line per problem, naming the key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from eagle3data.core.models import EMBEDDED_PREFIX, TOKENIZER_SOURCES, _load_plugins
from eagle3data.core.params import ParamsError
from eagle3data.hidden.store.failures import StatesNotMerged, require_merged_states
from eagle3data.prompts.load import check_dataset_files


def _not_a_folder(path: str) -> bool:
    """True for `embedded:NAME` and registered tokenizer sources (`models.TOKENIZER_SOURCES`), which are no folders."""
    if path.startswith(EMBEDDED_PREFIX):
        return True
    if ":" in path and not Path(path).exists():
        _load_plugins()
        return any(path.startswith(p) for p in TOKENIZER_SOURCES)
    return False


def ready_problems(params: Any, stages: list[str]) -> list[str]:
    """What stops the stages from running at all, each as one line naming the key or variable.

    Checked before any work: the model and tokenizer folders (for the stages that load them),
    every prompt dataset for 01 (`prompts.check_dataset_files`: UTF-8 JSON text or what its name
    says, a `.json` array not cut off, its first rows of its format and not all rejected, a
    folder's config picked; every bad dataset named, one line each), and, for the `openai`
    backend in 01, the environment variable that holds the API key, and, for 05 run without 04, that a
    format needing 04's states has a merged store (`require_merged_states`: 04 stopped or failed its samples).
    (A head-position cap 04's own verification cannot judge at is a params error:
    `core/params/hidden.positions_problem`.)
    """
    problems: list[str] = []
    m = params.model
    needs_model = "04_extract_hidden" in stages or ("01_generate" in stages and params.generate.backend == "local")
    checks = [("model.tokenizer_path", m.tokenizer_path)] if m.tokenizer_path else [("model.path", m.path)]
    if needs_model and m.tokenizer_path:
        checks.append(("model.path", m.path))
    for key, path in checks:
        if path and not _not_a_folder(path) and not Path(path).expanduser().exists():
            what = "tokenizer" if key.endswith("tokenizer_path") or not needs_model else "model"
            problems.append(f"{key}: {what} folder not found: {path}")
    if "01_generate" in stages:  # a prompt file that cannot be read by its format: one line each, before any notebook
        try:
            check_dataset_files(params)
        except ParamsError as e:
            problems.extend(x for x in str(e).splitlines() if x.strip())
    g = params.generate
    if "01_generate" in stages and g.backend == "openai" and g.openai is not None:
        env = g.openai.api_key_env
        if not os.environ.get(env, "").strip():
            problems.append(f"generate.openai.api_key_env: environment variable {env} is not set "
                            f"(export {env}=<key>; the key is never a param)")
    if "05_export" in stages and "04_extract_hidden" not in stages:
        for fmt in params.export.formats:
            try:
                require_merged_states(params, fmt)
            except StatesNotMerged as e:
                problems.append(f"export.formats: {e}")
                break  # one store, one line
    return problems
