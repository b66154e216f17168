"""03 read in chunks: the same verdicts, statuses, summary and files whatever the chunk, and memory set by the chunk.

A run on the real Qwen3 vocabulary (a fast tokenizer: the batch decode/encode path) holds what the audit must see
across chunks: turns of a conversation (on-policy and off), tool calls, unicode, an error superseded by its
retry, a key completed twice, an output equal to another prompt's, a non-canonical split (text.roundtrip),
text fields that do not match their ids, a truncated record, API records with 02's rebuilt ids and one without,
a bad line and a torn tail. Audited in memory (`audit_table` of `load_run`, one chunk) and read 2 lines at a
time (`audit_run_chunked`), everything the stage writes or shows is equal; the Kimi stand-in vocabulary (a slow
Python tokenizer: the per-record path) too. Then the chunked audit's peak of traced memory does not grow with
the number of records.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
import pytest

from eagle3data.audit.inspector import failing_records, inspect_record
from eagle3data.audit.run import audit_run_chunked, audit_table, run_audit
from eagle3data.audit.runtable import load_run
from eagle3data.core.params import load_params
from eagle3data.core.profiles import KIMI_K25, QWEN3
from eagle3data.core.spans import output_texts
from eagle3data.generate.turns import assistant_message
from eagle3data.prompts.load import Prompt, template_prompt
from runfiles import write_jsonl
from synthetic import SyntheticTokenizer, synthetic_records

REPO = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _record(tok, ds, sid, msgs, *, tools=None, think="Let me think.", answer="Done.", call=None, finish="stop",
            output=None, **kw) -> dict:
    """A qwen3 record whose text fields are the one split of its ids (as an exact backend writes them)."""
    prompt = template_prompt(tok, Prompt(ds, sid, msgs, tools), QWEN3)
    tc = QWEN3.tool_calls
    if output is None:
        output = ([QWEN3.reasoning_open.id] + _ids(tok, f"\n{think}\n") + [QWEN3.reasoning_close.id]
                  + _ids(tok, f"\n\n{answer}"))
        if call:
            output += [tc.call_begin.id] + _ids(tok, "\n" + orjson.dumps(call).decode() + "\n") + [tc.call_end.id]
        output += [QWEN3.end_of_turn.id]
    text = output_texts(output, QWEN3, tok)
    rec = {"dataset": ds, "sample_id": sid, "source": "local", "model": "m", "profile": "qwen3", "messages": msgs,
           "tools": tools, "prompt_ids": prompt, "output_ids": output, "ids_exact": True, "reasoning": text.reasoning,
           "content": text.content, "tool_calls": text.tool_calls, "finish_reason": finish,
           "usage": {"prompt_tokens": len(prompt)}, "provider": None}
    return rec | kw


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory, qwen) -> Path:
    run = tmp_path_factory.mktemp("stream") / "run"
    tok = qwen
    user = lambda s: [{"role": "user", "content": s}]  # noqa: E731
    r0 = _record(tok, "a", 0, user("Quel temps à Zürich ? ☔"), think="Zürich ☔ — 🎨 naïve",
                 answer="Il fait beau 🌞.")
    split = _ids(tok, " underst") + _ids(tok, "anding")
    assert _ids(tok, tok.decode(split)) != split  # a split the tokenizer would not make: text.roundtrip flags it
    a = [
        r0,
        _record(tok, "a", 1, [{"role": "system", "content": "You can look up the weather."}] + user("Weather in Oslo?"),
                tools=TOOLS, answer="Checking.", call={"name": "get_weather", "arguments": {"city": "Oslo"}}),
        {"dataset": "a", "sample_id": 2, "source": "local", "finish_reason": "error", "error": "timeout",
         "prompt_ids": None, "output_ids": None, "messages": user("two")},
        _record(tok, "a", 3, user("three")),
        _record(tok, "a", 2, user("two"), answer="The retry."),  # supersedes the error above
        _record(tok, "a", 3, user("three"), answer="Again."),  # key a/3 completed twice
        _record(tok, "a", 4, user("a different prompt"), output=r0["output_ids"]),  # r0's output for another prompt
        _record(tok, "a", 5, user("five"), output=[QWEN3.reasoning_open.id] + _ids(tok, "\nok\n")
                + [QWEN3.reasoning_close.id] + split + [QWEN3.end_of_turn.id]),
        _record(tok, "a", 6, user("six")) | {"content": "Not what the ids say."},
        _record(tok, "a", 7, user("seven"), finish="length", output=[QWEN3.reasoning_open.id] + _ids(tok, "\nlong")),
    ]
    write_jsonl(run / "records" / "a.jsonl", a)
    with open(run / "records" / "a.jsonl", "r+b") as f:  # a bad line in the middle, a torn tail at the end
        lines = f.read().splitlines(keepends=True)
        f.seek(0)
        f.write(b"".join(lines[:4] + [b"{not json\n"] + lines[4:]) + b'{"dataset": "a", "sample_id": 9, "out')
    # turns: c's turn 1 holds turn 0's own reply (on-policy); x's turn 1 holds the dataset's (off-policy)
    c0 = _record(tok, "b", "c", user("Name a colour."), answer="Blue.", turn=0)
    c1 = _record(tok, "b", "c", user("Name a colour.") + [assistant_message(c0)] + user("Another."), answer="Red.",
                 turn=1)
    x0 = _record(tok, "b", "x", user("Hi."), answer="Hello!", turn=0)
    x1 = _record(tok, "b", "x", user("Hi.") + [{"role": "assistant", "content": "DATASET hello"}] + user("Bye."),
                 answer="Bye!", turn=1)
    write_jsonl(run / "records" / "b.jsonl", [c0, x0, c1, x1])
    # API records: ids from 02's rebuilt lines (one record has none); billed prompt tokens off by one for one
    api, rebuilt = [], []
    for sid in range(4):
        r = _record(tok, "c", sid, user(f"api question {sid} ✓"), answer=f"Answer {sid}.")
        rebuilt.append({"dataset": "c", "sample_id": sid, "proof_level": "count", "prompt_ids": r["prompt_ids"],
                        "output_ids": r["output_ids"], "input_ids": r["prompt_ids"] + r["output_ids"],
                        "loss_mask": [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"]), "finish_reason": "stop"})
        api.append(r | {"source": "api", "provider": "P", "output_ids": None, "ids_exact": False,
                        "usage": {"prompt_tokens": len(r["prompt_ids"]) + (sid == 2)}})
    write_jsonl(run / "records" / "c.jsonl", api)
    write_jsonl(run / "reconstruct" / "c.jsonl", rebuilt[:3])
    return run


def _same(x, y) -> None:
    """Two audits of one run agree on everything the stage writes and shows (the time taken aside)."""
    assert x.status.equals(y.status)
    pd.testing.assert_frame_equal(x.verdicts(), y.verdicts())
    sx, sy = x.summary(), y.summary()
    sx.pop("seconds"), sy.pop("seconds")
    assert sx == sy
    pd.testing.assert_frame_equal(x.meta, y.meta)
    pd.testing.assert_frame_equal(x.superseded, y.superseded)
    pd.testing.assert_frame_equal(x.check_table(), y.check_table())
    pd.testing.assert_frame_equal(x.group_table(), y.group_table())
    pd.testing.assert_frame_equal(x.lengths(), y.lengths())
    for f in ("first_close", "first_eot", "n_close", "n_eot", "n_open", "reasoning_start"):
        assert np.array_equal(getattr(x.positions, f), getattr(y.positions, f)), f
    pd.testing.assert_frame_equal(x.positions.events, y.positions.events)
    pd.testing.assert_frame_equal(x.positions.tool_sections, y.positions.tool_sections, check_dtype=False)
    assert x.notes == y.notes and x.prompt_calibration == y.prompt_calibration


def test_chunks_of_two_lines_audit_as_one_chunk_does(qwen_run, qwen, tmp_path):
    mem = audit_table(load_run(qwen_run, source_fields=True), QWEN3, tokenizer=qwen)
    small = audit_run_chunked(qwen_run, QWEN3, tokenizer=qwen, chunk_records=2)
    big = audit_run_chunked(qwen_run, QWEN3, tokenizer=qwen, chunk_records=10_000)
    for other in (small, big):
        _same(mem, other)
        for out in ("m", "o"):
            (tmp_path / out).mkdir(exist_ok=True)
        mem.write(tmp_path / "m")
        other.write(tmp_path / "o")
        assert (tmp_path / "m" / "verdicts.jsonl").read_bytes() == (tmp_path / "o" / "verdicts.jsonl").read_bytes()
    # what the fixture put there was seen across chunks
    v = {(r.dataset, str(r.sample_id), r.turn if r.turn == r.turn else None): (r.failed, r.flagged)
         for r in small.meta.assign(failed=small.failed_lists(), flagged=small.failed_lists(4)).itertuples()}
    assert v[("a", "0", None)][0] == ["dataset.distinct_outputs"] and v[("a", "4", None)][0] == ["dataset.distinct_outputs"]
    assert v[("a", "3", None)][0] == ["dataset.unique_sample_id"]
    assert v[("a", "5", None)] == ([], ["text.roundtrip"])
    assert v[("a", "6", None)][0] == ["text.fields_match"]
    assert v[("a", "1", None)] == ([], []) and v[("a", "2", None)] == ([], []) and v[("a", "7", None)] == ([], [])
    assert v[("b", "c", 1)] == ([], []) and v[("b", "x", 1)][0] == ["prompt.on_policy"]
    assert v[("c", "0", None)] == ([], []) and v[("c", "3", None)][0] == ["record.has_ids"]
    assert v[("c", "2", None)][0] == ["prompt.billed_count"]
    s = small.summary()
    assert s["superseded_lines"] == 2  # the error, and a/3's first completed line
    assert len(s["bad_lines"]) == 1 and "a.jsonl:5: not JSON" in s["bad_lines"][0] and s["torn_tail_bytes"] > 0
    # the inspector reads its records back from their lines: the same views
    for ds, sid in (("a", 0), ("a", 1), ("a", 5), ("b", "c#1"), ("c", 1), ("c", 3), ("a", 99)):
        assert inspect_record(small, ds, sid, qwen).html == inspect_record(mem, ds, sid, qwen).html, (ds, sid)
    assert [v.html for v in failing_records(small, qwen, 2)] == [v.html for v in failing_records(mem, qwen, 2)]
    assert small.table.output_ids(0).tolist() == mem.table.output_ids(0).tolist()
    c1 = int(np.flatnonzero((small.meta["dataset"] == "c").to_numpy())[1])
    assert small.table.prompt_ids(c1).tolist() == mem.table.prompt_ids(c1).tolist()
    assert small.table.loss_mask[c1] == mem.table.loss_mask[c1]


def test_run_audit_writes_the_same_files_for_any_chunk(qwen_run, qwen, tmp_path):
    import shutil

    outs = {}
    for chunk in (1, 3, 512):
        run = tmp_path / f"r{chunk}" / "run"
        shutil.copytree(qwen_run, run)
        params = load_params(REPO / "params" / "ci.yaml", {"output_root": str(run.parent), "run_name": "run",
                                                             "profile": "qwen3", "audit.chunk_records": chunk})
        run_audit(params, progress=False, tokenizer=qwen)
        outs[chunk] = ((run / "audit" / "verdicts.jsonl").read_bytes(),
                       {k: v for k, v in orjson.loads((run / "audit" / "summary.json").read_bytes()).items()
                        if k not in ("seconds", "bad_lines", "superseded")})
    assert outs[1] == outs[3] == outs[512]


def test_a_slow_tokenizer_audits_alike_in_chunks(tmp_path):
    """The Kimi stand-in (a Python tokenizer: per-record calls) on synthetic records with tools and truncation."""
    recs = synthetic_records(9, seed=3, max_output=600, tool_share=0.5, truncated_share=0.3)
    recs[4] = dict(recs[4], output_ids=recs[1]["output_ids"])  # another prompt's output
    write_jsonl(tmp_path / "records" / "synthetic.jsonl", recs + [recs[2]])  # and a key completed twice
    tok = SyntheticTokenizer()
    mem = audit_table(load_run(tmp_path, source_fields=True), KIMI_K25, tokenizer=tok)
    small = audit_run_chunked(tmp_path, KIMI_K25, tokenizer=tok, chunk_records=2)
    _same(mem, small)
    failed = dict(zip(small.meta["sample_id"], small.failed_lists()))
    assert "dataset.distinct_outputs" in failed[1] and "dataset.distinct_outputs" in failed[4]
    assert "dataset.unique_sample_id" in failed[2]


def _peak(run: Path, chunk: int) -> int:
    tracemalloc.start()
    try:
        audit_run_chunked(run, KIMI_K25, chunk_records=chunk)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_set_by_the_chunk_not_the_run(tmp_path):
    """Peak traced memory (Python objects and numpy buffers) of a chunked audit at N and 4N records: within 1.3x,
    while the run's ids grow 4x (the in-memory audit's peak grows with them)."""
    recs = synthetic_records(60, seed=5, min_output=4000, max_output=6000, tool_share=0.3)
    for name, k in (("n", 1), ("n4", 4)):
        rows = [dict(r, sample_id=f"{j}-{r['sample_id']}") for j in range(k) for r in recs]
        write_jsonl(tmp_path / name / "records" / "synthetic.jsonl", rows)
    _peak(tmp_path / "n", 4)  # once first: what the first audit allocates once (imports, caches) is no record's
    small, large = _peak(tmp_path / "n", 4), _peak(tmp_path / "n4", 4)
    assert large < 1.3 * small, (small, large)
    tracemalloc.start()
    try:
        audit_table(load_run(tmp_path / "n4"), KIMI_K25)
        in_memory = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert in_memory > 3 * large, (in_memory, large)


@pytest.mark.parametrize("data", [
    b"", b'{"dataset": "a", "sample', b"\n{bad\n\n",
    b"".join(orjson.dumps({"dataset": "a", "sample_id": i, "finish_reason": "stop", "output_ids": [1, 2, i],
                           "prompt_ids": [3]}) + end for i, end in zip(range(7), [b"\n", b"\r\n"] * 4)) + b'{"x',
    b'{"dataset":"a","sample_id":1,"finish_reason":"stop"}\r{"dataset":"a","sample_id":2,"finish_reason":"stop"}\n'
    b'{bad}\n{"dataset":"a","sample_id":3,"finish_reason":"stop","output_ids":[5]}\n',
], ids=["empty", "torn-only", "blank-and-bad", "crlf-and-torn", "lone-cr"])
def test_journal_chunks_read_as_the_whole_file_reader(tmp_path, data):
    """Line numbers, bad lines, ids and the torn tail of a journal read 1, 2 or 3 lines at a time are
    `read_journal`'s; each row's byte offset is its line's."""
    from eagle3data.audit.idtable import read_journal
    from eagle3data.audit.streamed import journal_chunks

    path = tmp_path / "a.jsonl"
    path.write_bytes(data)
    whole = read_journal(path, source_fields=True)
    for chunk in (1, 2, 3):
        *chunks, torn = journal_chunks(path, chunk)
        assert [x for c in chunks for x in c.table.meta["line"].tolist()] == whole.meta["line"].tolist()
        assert [b for c in chunks for b in c.table.bad_lines] == whole.bad_lines and torn == whole.torn_tail_bytes
        assert [c.table.output_ids(i).tolist() for c in chunks for i in range(len(c.table))] == \
            [whole.output_ids(i).tolist() for i in range(len(whole))]
        assert all(data[s : s + 1] == b"{" for c in chunks for s in c.starts.tolist())
