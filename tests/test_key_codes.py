"""The keys of a table as one array (`SampleKey.codes_of_frame`) are the keys `of_frame` spells, row for
row, and the supersede rule on arrays picks the lines the per-row rule picks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from eagle3data.core.reader import SampleKey, supersede_codes, supersede_rule


def _same_partition(codes: np.ndarray, keys: list) -> None:
    n = len(keys)
    assert codes.dtype == np.int64 and len(codes) == n
    for i in range(n):
        for j in range(n):
            assert (codes[i] == codes[j]) == (keys[i] == keys[j]), (i, j, keys[i], keys[j])


FRAMES = {
    "ints": pd.DataFrame({"dataset": ["a", "a", "b", "a"], "sample_id": [1, 2, 1, 1]}),
    "int and its text": pd.DataFrame({"dataset": ["a", "a", "a"], "sample_id": pd.Series([1, "1", 1.0], dtype=object)}),
    "turns with NaN": pd.DataFrame({"dataset": ["d"] * 5, "sample_id": ["5", "5", "6", "5", "6"],
                                    "turn": [1, None, float("nan"), 1.0, 0]}),
    "a # in a sample_id beside turns": pd.DataFrame({"dataset": ["d", "d", "d"], "sample_id": ["a#1", "a", "a"],
                                                      "turn": [None, 1, 2]}),
    "a / in a dataset": pd.DataFrame({"dataset": ["x/y", "x", "x"], "sample_id": ["z", "y/z", "q"]}),
    "None and NA": pd.DataFrame({"dataset": ["d", "d", "d", "d"], "sample_id": pd.Series([None, "None", 3, 3], dtype=object),
                                 "turn": pd.array([pd.NA, None, 2, pd.NA], dtype=object)}),
    "string dtype with missing": pd.DataFrame({"dataset": pd.array(["d", None, "d"], dtype="string"),
                                               "sample_id": [1, 1, 1]}),
    "nullable integer turns": pd.DataFrame({"dataset": ["d"] * 4, "sample_id": [1, 1, 1, 2],
                                            "turn": pd.array([1, None, 1, None], dtype="Int64")}),
    "integer turns, every row": pd.DataFrame({"dataset": ["d"] * 3, "sample_id": [1, 1, 2], "turn": [0, 1, 0]}),
    "one dataset, booleans": pd.DataFrame({"dataset": ["d"] * 3, "sample_id": [True, False, True]}),
}


@pytest.mark.parametrize("name", list(FRAMES))
def test_codes_are_the_keys_of_frame(name):
    frame = FRAMES[name]
    _same_partition(SampleKey.codes_of_frame(frame), SampleKey.of_frame(frame))
    as_dict = {c: frame[c].tolist() for c in frame.columns}  # a dict of columns, as of_frame takes
    _same_partition(SampleKey.codes_of_frame(as_dict), SampleKey.of_frame(as_dict))


def test_codes_of_many_random_rows_match_the_keys():
    rng = np.random.default_rng(3)
    n = 4000
    frame = pd.DataFrame({"dataset": rng.choice(["b1", "b2", "b7"], n), "sample_id": rng.integers(0, 600, n),
                          "turn": pd.array([None if x < 0 else int(x) for x in rng.integers(-3, 3, n)], dtype=object)})
    codes, keys = SampleKey.codes_of_frame(frame), SampleKey.of_frame(frame)
    first = {}
    want = np.array([first.setdefault(k, len(first)) for k in keys])
    assert (codes == want).all()  # the same numbering too: in order of first appearance
    assert len(SampleKey.codes_of_frame(frame.iloc[:0])) == 0


def test_supersede_on_arrays_is_the_rule():
    rng = np.random.default_rng(7)
    keys = [f"k{x}" for x in rng.integers(0, 50, 800)]
    frs = list(rng.choice(["stop", "length", "error", "abort", None], 800))
    is_record, dup = supersede_rule(keys, frs)
    # the rule by its words, key by key: the latest completed line, else the latest line
    for k in set(keys):
        lines = [i for i, x in enumerate(keys) if x == k]
        done = [i for i in lines if frs[i] in ("stop", "length")]
        chosen = done[-1] if done else lines[-1]
        assert [is_record[i] for i in lines] == [i == chosen for i in lines]
        assert [dup[i] for i in lines] == [i == chosen and len(done) > 1 for i in lines]
    codes = SampleKey.codes_of_frame(pd.DataFrame({"dataset": ["d"] * 800, "sample_id": keys}))
    r2, d2 = supersede_codes(codes, np.isin(np.array(frs, dtype=object), ["stop", "length"]))
    assert r2.tolist() == is_record and d2.tolist() == dup
