"""03_audit: the fast JSONL reader gives exactly what orjson line by line gives, on real and adversarial journals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
import pytest

from eagle3data.audit.run import audit_table
from eagle3data.audit.idtable import AuditInputError, _read_orjson, _split_torn, read_journal
from eagle3data.core.profiles import KIMI_K25
from synthetic import synthetic_records

ARRAYS = ("prompt", "prompt_off", "has_prompt", "output", "output_off", "has_output")
LISTS = ("messages", "tools", "reasoning", "content", "loss_mask")


def reference(path: Path, source_fields: bool = True):
    """The line reader: orjson on every whole line (what the fast path must reproduce)."""
    data, torn = _split_torn(path.read_bytes())
    t = _read_orjson(path, data, source_fields)
    t.torn_tail_bytes = torn
    t.meta["file"] = str(path)
    return t


def assert_same(path: Path) -> None:
    for source_fields in (False, True):
        fast, ref = read_journal(path, source_fields=source_fields), reference(path, source_fields)
        for a in ARRAYS:
            assert np.array_equal(getattr(fast, a), getattr(ref, a)), a
            assert getattr(fast, a).dtype.kind == getattr(ref, a).dtype.kind, a
        pd.testing.assert_frame_equal(fast.meta, ref.meta)
        assert fast.bad_lines == ref.bad_lines
        assert fast.torn_tail_bytes == ref.torn_tail_bytes
        for f in LISTS:
            assert getattr(fast, f) == getattr(ref, f), f


def test_real_journals_read_the_same(ci_run, tmp_path):
    """The embedded run's journals (exact and API-style records) and synthetic Kimi records."""
    paths = sorted((ci_run.run_dir / "records").glob("*.jsonl"))
    assert paths
    for p in paths:
        assert_same(p)
    recs = synthetic_records(40, seed=3, max_output=2000, tool_share=0.4, truncated_share=0.2)
    p = tmp_path / "kimi.jsonl"
    p.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    assert_same(p)
    t = read_journal(p)
    assert t.output_ids(5).tolist() == recs[5]["output_ids"] and t.prompt_ids(7).tolist() == recs[7]["prompt_ids"]


def _base(i: int) -> dict:
    return {"dataset": "d", "sample_id": i, "source": "local", "provider": None, "finish_reason": "stop",
            "ids_exact": True, "prompt_ids": [1, 2, 3 + i], "output_ids": [10, 20, 30 + i], "reasoning": "r",
            "content": "c", "messages": [{"role": "user", "content": "hi"}], "tools": None}


ADVERSARIAL = [
    # keys in another order, ids first or last
    b'{"output_ids":[5,6,7],"prompt_ids":[1,2],"dataset":"d","sample_id":1,"finish_reason":"stop"}',
    b'{"dataset":"d","sample_id":2,"finish_reason":"stop","prompt_ids":[1],"output_ids":[0,9]}',
    # whitespace as json.dumps writes it, and odd whitespace inside lists
    json.dumps(_base(3)).encode(),
    b'{"dataset":"d","sample_id":4,"finish_reason":"stop","prompt_ids":[1, 2],"output_ids":[ 3,4 ]}',
    b'{"dataset":"d","sample_id":5,"finish_reason":"stop","prompt_ids":[1,\t2],"output_ids":[3 ,4]}',
    # strings holding the key names (escaped quotes), and a ']' inside a string before the list
    orjson.dumps({**_base(6), "content": '"output_ids":[9,9] and "prompt_ids":[8]', "reasoning": "a]b"}),
    # a nested key of the same name before the top-level one, and no top-level key at all
    b'{"usage":{"output_ids":[7,7]},"dataset":"d","sample_id":7,"finish_reason":"stop","prompt_ids":[1],'
    b'"output_ids":[2,3]}',
    b'{"meta":{"output_ids":[7,7],"prompt_ids":[1]},"dataset":"d","sample_id":8,"finish_reason":"stop"}',
    # duplicate top-level keys (orjson's choice must win either way)
    b'{"dataset":"d","sample_id":9,"finish_reason":"stop","prompt_ids":[1],"output_ids":[4],"output_ids":[5,6]}',
    # nulls, empty lists, negative and zero ids, -0
    b'{"dataset":"d","sample_id":10,"finish_reason":"stop","prompt_ids":null,"output_ids":null}',
    b'{"dataset":"d","sample_id":11,"finish_reason":"length","prompt_ids":[],"output_ids":[ ]}',
    b'{"dataset":"d","sample_id":12,"finish_reason":"stop","prompt_ids":[0],"output_ids":[-5,0,-0,163839]}',
    b'{"dataset":"d","sample_id":"13","finish_reason":"stop","prompt_ids":[1],"output_ids":[999999999999999999]}',
    # escapes in the key itself (same key to a JSON parser, different bytes)
    b'{"dataset":"d","sample_id":14,"finish_reason":"stop","prompt\\u005fids":[1],"output_ids":[2]}',
    # not JSON inside the list only: leading zero, '+', trailing comma, fraction, huge int
    b'{"dataset":"d","sample_id":15,"finish_reason":"stop","prompt_ids":[1],"output_ids":[01,2]}',
    b'{"dataset":"d","sample_id":16,"finish_reason":"stop","prompt_ids":[1],"output_ids":[+1,2]}',
    b'{"dataset":"d","sample_id":17,"finish_reason":"stop","prompt_ids":[1],"output_ids":[1,2,]}',
    b'{"dataset":"d","sample_id":18,"finish_reason":"stop","prompt_ids":[1],"output_ids":[1-2]}',
    # other bad lines: not JSON, not an object, a key field missing, blank
    b'{"dataset":"d","sample_id":20,"finish_reason":"stop","prompt_ids":[1],"output_ids":[2]',
    b'[1,2,3]',
    b'{"dataset":"d","finish_reason":"stop","prompt_ids":[1],"output_ids":[2]}',
    b"   ",
    b"",
    # unicode and escapes around the lists
    orjson.dumps({**_base(21), "content": "é\u2028\\\"]", "messages": [{"role": "user", "content": "[1,2]"}]}),
]


def test_adversarial_lines_read_the_same(tmp_path):
    """Key order, whitespace, key names inside strings, nested and duplicate keys, nulls, bad numbers, bad lines."""
    p = tmp_path / "adv.jsonl"
    lines = [orjson.dumps(_base(100))] + ADVERSARIAL + [orjson.dumps(_base(101))]
    p.write_bytes(b"\n".join(lines) + b"\n" + b'{"dataset":"d","sample_id":102,"output_')  # torn tail
    assert_same(p)
    t = read_journal(p)
    sid = t.meta["sample_id"].tolist()
    assert 7 in sid and t.output_ids(sid.index(7)).tolist() == [2, 3]
    assert t.output_ids(sid.index(12)).tolist() == [-5, 0, 0, 163839]
    assert not t.has_output[sid.index(8)] and not t.has_output[sid.index(10)]
    assert t.has_output[sid.index(11)] and len(t.output_ids(sid.index(11))) == 0
    assert sum("not JSON" in b for b in t.bad_lines) == 5  # 01, +1, trailing comma, 1-2, cut line
    assert t.torn_tail_bytes > 0


@pytest.mark.parametrize("line", [
    b'{"dataset":"d","sample_id":1,"finish_reason":"stop","prompt_ids":[1],"output_ids":[1.5,2]}',
    b'{"dataset":"d","sample_id":1,"finish_reason":"stop","prompt_ids":[1],"output_ids":[[1],2]}',
    b'{"dataset":"d","sample_id":1,"finish_reason":"stop","prompt_ids":[1],"output_ids":["1"]}',
    b'{"dataset":"d","sample_id":1,"finish_reason":"stop","prompt_ids":[true],"output_ids":[1]}',
    b'{"dataset":"d","sample_id":1,"finish_reason":"stop","prompt_ids":[1],"output_ids":"1,2"}',
    b'{"dataset":"d","sample_id":1,"finish_reason":"stop","prompt_ids":[1],"output_ids":[99999999999999999999]}',
])
def test_ids_that_are_not_integers_are_a_clear_error(line, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(orjson.dumps(_base(0)) + b"\n" + line + b"\n")
    with pytest.raises(AuditInputError) as fast:
        read_journal(p)
    with pytest.raises(AuditInputError) as ref:
        reference(p)
    assert str(fast.value) == str(ref.value) and f"{p}:2" in str(fast.value)


def test_ids_beyond_64_bits_are_a_clear_error(tmp_path):
    p = tmp_path / "big.jsonl"
    p.write_bytes(b'{"dataset":"d","sample_id":1,"finish_reason":"stop","prompt_ids":[1],'
                  b'"output_ids":[5,9223372036854775808]}\n')
    for read in (read_journal, reference):
        with pytest.raises(AuditInputError, match=f"{p}:1: field `output_ids` holds an id beyond 64-bit"):
            read(p)


def test_randomly_formatted_journals_read_the_same(tmp_path):
    """Random key order, separators and null/empty lists over many records; CRLF line ends too."""
    rng = random.Random(5)
    recs = synthetic_records(30, seed=11, max_output=600, tool_share=0.3, truncated_share=0.3)
    lines = []
    for r in recs:
        r = dict(r)
        if rng.random() < 0.2:
            r["output_ids"] = None
        if rng.random() < 0.1:
            r["prompt_ids"] = []
        keys = list(r)
        rng.shuffle(keys)
        r = {k: r[k] for k in keys}
        style = rng.randrange(3)
        lines.append(orjson.dumps(r) if style == 0 else
                     json.dumps(r, ensure_ascii=rng.random() < 0.5).encode() if style == 1 else
                     json.dumps(r, separators=(",", ":")).encode())
    p = tmp_path / "mixed.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    assert_same(p)
    q = tmp_path / "crlf.jsonl"
    q.write_bytes(b"\r\n".join(lines) + b"\r\n")
    assert_same(q)
    fast, ref = audit_table(read_journal(p), KIMI_K25), audit_table(reference(p, False), KIMI_K25)
    pd.testing.assert_frame_equal(fast.status, ref.status)


@pytest.mark.parametrize("content", [b"", b"\n", b"  \n\n", b'{"dataset":"d"',
                                     b'{"dataset":"d","sample_id":1,"finish_reason":"stop","output_ids":[1]}\n'])
def test_empty_blank_torn_and_prompt_less_journals_read_the_same(content, tmp_path):
    p = tmp_path / "small.jsonl"
    p.write_bytes(content)
    assert_same(p)
