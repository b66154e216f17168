"""03_audit: the vectorized scans agree with plain Python on awkward arrays (dtypes, negatives, chunk edges)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from eagle3data.audit import checks
from eagle3data.audit.checks import FAIL, NA, PASS, cross_record_checks, special_events, structural_checks
from eagle3data.audit.idtable import IdTable
from eagle3data.core.profiles import KIMI_K25


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16, np.uint32])
def test_special_events_match_a_python_scan(dtype, monkeypatch):
    monkeypatch.setattr(checks, "_CHUNK", 1000)  # many chunks, hits on their edges
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    ids = rng.integers(max(info.min, -3000), min(info.max, 3000), size=5000).astype(dtype)
    ids[[0, 999, 1000, 1001, 4999]] = [7, 9, 7, 12, 9]
    if info.min < 0:
        ids[[5, 6]] = [info.min, -7]
    ids[[7, 8]] = [info.max, 12]
    off = np.array([0, 1000, 1000, 2500, 5000])
    codes = {7: 1, 9: 2, 12: 3}
    rec, rel, code = special_events(ids, off, codes)
    want = [(np.searchsorted(off, p, side="right") - 1, codes[int(t)]) for p, t in enumerate(ids.tolist())
            if int(t) in codes]
    assert [(int(r), int(c)) for r, c in zip(rec, code)] == want
    assert np.array_equal(off[rec] + rel, np.flatnonzero(np.isin(ids, list(codes))))


def _table(outputs: list[list[int]], prompts: list[list[int]]) -> IdTable:
    def flat(lists):
        off = np.zeros(len(lists) + 1, np.int64)
        np.cumsum([len(x) for x in lists], out=off[1:])
        return np.concatenate([np.asarray(x, np.int32) for x in lists]), off, np.ones(len(lists), bool)

    meta = pd.DataFrame({"dataset": "d", "sample_id": range(len(outputs)), "source": "local", "provider": None,
                         "finish_reason": "stop", "ids_exact": True})
    return IdTable(meta, *flat(prompts), *flat(outputs))


def test_distinct_outputs_compares_whole_outputs_not_samples():
    """Outputs equal at every sampled position but one id apart are distinct; identical ones are caught."""
    base = list(range(100, 200))
    near = base.copy()
    near[30] = 5  # not one of the 9 sampled positions (0, 12, 24, 37, ...) of a 100-token output
    t = _table([base, near, base, base, []], [[1], [2], [3], [1], [4]])
    st = cross_record_checks(t)["dataset.distinct_outputs"]
    assert st.tolist() == [FAIL, PASS, FAIL, FAIL, NA]  # 0, 2, 3 share an output, 2 has another prompt


def test_negative_and_oversized_ids_fail_the_vocab_check():
    p = KIMI_K25
    eot = p.end_of_turn.id
    close = p.reasoning_close.id
    t = _table([[5, close, 6, eot], [5, close, -1, eot], [5, close, p.vocab_size, eot]], [[1], [2], [3]])
    st, _ = structural_checks(t, p)
    assert st["output.ids_in_vocab"].tolist() == [PASS, FAIL, FAIL]
    assert st["output.ends_with_eot"].tolist() == [PASS, PASS, PASS]
