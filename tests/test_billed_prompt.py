"""03's `prompt.billed_count`: an API record's billed prompt tokens must match the prompt we templated.

The provider bills the prompt it rendered; when that is not our `prompt_ids` (it injects a system
prompt, renders the tools or the history its own way), the record's prompt ids are not what the
model saw. Offsets are learned per (provider, dataset) with 02's rule (`stats.calibrated_offset`).
"""

from __future__ import annotations

import orjson

from eagle3data.audit.run import audit_table
from eagle3data.audit.checks import FAIL, NA, PASS
from eagle3data.audit.idtable import read_journal
from eagle3data.core.profiles import SMOLLM2


def _rec(sid: int, provider: str, n_prompt: int, billed: int | None, *, source: str = "api") -> dict:
    prompt = [1, 9690, 198] + [100 + (sid + k) % 500 for k in range(n_prompt - 6)] + [2, 1, 520]
    return {"dataset": "chat", "sample_id": sid, "source": source, "provider": provider, "model": "m",
            "profile": "smollm2", "messages": [{"role": "user", "content": f"q{sid} — ünïcode"}], "tools": None,
            "prompt_ids": prompt, "output_ids": [100, 2] if source != "api" else None,
            "ids_exact": source != "api", "reasoning": None, "content": "x", "finish_reason": "stop",
            "usage": None if billed is None else {"prompt_tokens": billed, "completion_tokens": 2}}


def _audit(tmp_path, recs, **kw):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    result = audit_table(read_journal(path, source_fields=True), SMOLLM2, **kw)
    return result, dict(zip(result.meta["sample_id"], result.status["prompt.billed_count"]))


def test_billed_prompt_count_equal_passes_and_a_different_prompt_fails(tmp_path):
    recs = [_rec(i, "Moonshot", 20 + i, 20 + i) for i in range(12)]
    recs.append(_rec(12, "Moonshot", 30, 30 + 14))  # the provider rendered 14 more tokens (a system prompt)
    recs.append(_rec(13, "Moonshot", 30, None))  # no usage: not checked
    recs.append(_rec(14, "local", 30, 30, source="local"))  # engine ids: not an API record
    result, st = _audit(tmp_path, recs)
    assert all(st[i] == PASS for i in range(12))
    assert st[12] == FAIL and st[13] == NA and st[14] == NA
    (row,) = result.prompt_calibration
    assert row == {"provider": "Moonshot", "dataset": "chat", "records": 13, "prompt_offset": 0, "calibrated": True,
                   "mode": 0, "mode_share": round(12 / 13, 4), "off_offset": 1}
    assert any("1/13 record(s) off it" in n for n in result.notes)


def test_a_provider_offset_is_learned_per_provider_and_a_record_off_it_is_flagged(tmp_path):
    # provider A bills one token more than our template on every prompt (e.g. a BOS it adds): learned as +1;
    # provider B bills exactly; one A record is off A's offset, one B record has A's +1 (off B's 0)
    recs = [_rec(i, "A", 20 + i, 21 + i) for i in range(11)] + [_rec(11, "A", 40, 40)]
    recs += [_rec(20 + i, "B", 25, 25) for i in range(11)] + [_rec(31, "B", 25, 26)]
    result, st = _audit(tmp_path, recs)
    assert [st[i] for i in range(12)] == [PASS] * 11 + [FAIL]
    assert [st[20 + i] for i in range(12)] == [PASS] * 11 + [FAIL]
    offsets = {r["provider"]: (r["prompt_offset"], r["calibrated"], r["off_offset"]) for r in result.prompt_calibration}
    assert offsets == {"A": (1, True, 1), "B": (0, True, 1)}
    assert result.summary()["checks"]["prompt.billed_count"]["failed"] == 2


def test_too_few_records_to_calibrate_means_billed_must_equal_ours(tmp_path):
    recs = [_rec(i, "A", 20, 21) for i in range(5)]  # +1 on all, but 5 < calibration_min_records
    _, st = _audit(tmp_path, recs)
    assert set(st.values()) == {FAIL}
    _, st = _audit(tmp_path, recs, calibration={"min_records": 5})
    assert set(st.values()) == {PASS}
