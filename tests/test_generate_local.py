"""01_generate local backend: a graceful stop finishes the rows in flight, a second signal drops them,
a resumed run finishes every sample exactly once, and continuous batching on the embedded SmolLM2 gives
every prompt the ids of sequential greedy `model.generate`.

The stop tests use a scripted stand-in (`scripted_lm.ScriptedLM`: fixed output ids, a hook per prefill)
so each stop lands at a known prompt.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle3data.generate.run import run_generate
from eagle3data.core.params import load_params
from eagle3data.core.profiles import SMOLLM2
from eagle3data.core.records import scan_journal
from runfiles import assert_ledger_adds_up
from scripted_lm import ScriptedLM

REPO = Path(__file__).resolve().parents[1]


def ScriptedModel(hook=lambda n: None) -> ScriptedLM:
    """Answers every prompt with the same three ids (the last one end-of-turn); `hook(n)` before the n-th prefill."""
    return ScriptedLM(lambda prompt: [9, 10, SMOLLM2.end_of_turn.id], SMOLLM2.end_of_turn.id, hook)


@pytest.fixture
def params(tmp_path):
    """ci.yaml (2 datasets x 2 prompts) one prompt per batch: four batches."""
    return load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "generate.batch_size": 1})


def ledger_totals(led) -> dict[str, int]:
    """Totals over datasets of a ledger that adds up (zero counts left out)."""
    tot = Counter()
    for d in led["datasets"].values():
        tot.update({k: d[k] for k in ("planned", "done", "skipped", "cancelled")})
    return dict(+tot)


def journaled(params) -> Counter:
    keys: Counter = Counter()
    for path in (params.run_dir / "records").glob("*.jsonl"):
        scan = scan_journal(path)
        assert not scan.bad_lines and not scan.torn_tail_bytes
        keys.update((r["dataset"], r["sample_id"]) for r in scan.records)
    return keys


def test_first_signal_stops_after_the_batch_and_resume_finishes(params, smollm2_tokenizer):
    before = signal.getsignal(signal.SIGINT)
    model = ScriptedModel(lambda n: os.kill(os.getpid(), signal.SIGINT) if n == 2 else None)
    s = run_generate(params, progress=False, model=model, tokenizer=smollm2_tokenizer)
    assert s.status == "stopped" and "SIGINT" in s.stop_reason
    assert model.calls == 2 and s.new_records == 2  # the row in flight was finished and journaled
    led = assert_ledger_adds_up(params.run_dir)
    assert led["status"] == "stopped" and "SIGINT" in led["stop_reason"]
    assert ledger_totals(led) == {"planned": 4, "done": 2, "skipped": 2}  # the rest never sent
    assert signal.getsignal(signal.SIGINT) is before  # handlers put back

    again = run_generate(params, progress=False, model=ScriptedModel(), tokenizer=smollm2_tokenizer)
    assert again.status == "finished" and again.new_records == 2
    assert ledger_totals(assert_ledger_adds_up(params.run_dir)) == {"planned": 4, "done": 4}
    keys = journaled(params)
    assert len(keys) == 4 and set(keys.values()) == {1}  # every sample exactly once


def test_second_signal_drops_the_batch_in_progress(params, smollm2_tokenizer):
    def twice(n):
        if n == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
    s = run_generate(params, progress=False, model=ScriptedModel(twice), tokenizer=smollm2_tokenizer)
    assert s.status == "cancelled" and "second SIGINT" in s.stop_reason
    assert s.new_records == 1 and sum(journaled(params).values()) == 1
    led = assert_ledger_adds_up(params.run_dir)
    assert led["status"] == "cancelled"
    assert ledger_totals(led) == {"planned": 4, "done": 1, "cancelled": 1, "skipped": 2}


def test_stop_file_stops_after_the_batch(params, smollm2_tokenizer):
    stop = params.run_dir / "STOP"
    s = run_generate(params, progress=False, model=ScriptedModel(lambda n: stop.touch() if n == 1 else None),
                     tokenizer=smollm2_tokenizer)
    assert s.status == "stopped" and "STOP file" in s.stop_reason and s.new_records == 1
    led = assert_ledger_adds_up(params.run_dir)
    assert led["status"] == "stopped" and ledger_totals(led) == {"planned": 4, "done": 1, "skipped": 3}


def test_an_interrupt_that_is_not_a_stop_request_propagates(params, smollm2_tokenizer):
    def boom(n):
        raise KeyboardInterrupt  # e.g. raised by code of the user's, not by our signal handler
    with pytest.raises(KeyboardInterrupt):
        run_generate(params, progress=False, model=ScriptedModel(boom), tokenizer=smollm2_tokenizer)


def _prompt_file(path: Path, n: int, word: str) -> Path:
    """n one-turn prompts (one letter differs), sample ids 0..n-1."""
    import orjson

    rows = [orjson.dumps({"sample_id": i, "messages": [{"role": "user", "content": f"{word} {'abcdefgh'[i]}?"}]})
            for i in range(n)]
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


def test_batches_stay_full_when_a_budget_skips_prompts(tmp_path, smollm2_tokenizer):
    """One loop: a prompt whose dataset reached its budget leaves its slot to the next prompt. `a` (budget
    1 token) is cut once its first two rows are journaled: two records of `a` (the first slots are always
    filled), the third skipped; `b`'s four prompts then take the two slots, and every decode step runs both."""
    datasets = [{"name": "a", "path": str(_prompt_file(tmp_path / "a.jsonl", 3, "Apple")), "token_budget": 1},
                {"name": "b", "path": str(_prompt_file(tmp_path / "b.jsonl", 4, "Berry"))}]
    params = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path / "out"), "datasets": datasets,
                                                       "generate.batch_size": 2})
    model = ScriptedModel()
    s = run_generate(params, progress=False, model=model, tokenizer=smollm2_tokenizer)
    assert s.status == "finished" and s.new_records == 6
    assert model.steps == [2] * 6  # every decode step full: the skipped a/2 left no hole
    which = ["Apple" if "Apple" in smollm2_tokenizer.decode(p) else "Berry" for p in model.prompts]
    assert which == ["Apple", "Apple", "Berry", "Berry", "Berry", "Berry"]
    keys = journaled(params)
    assert set(keys.values()) == {1} and len(keys) == 6
    sent_a = {sid for d, sid in keys if d == "a"}
    led = assert_ledger_adds_up(params.run_dir)
    a, b = led["datasets"]["a"], led["datasets"]["b"]
    assert a["budget_reached"] and (a["planned"], a["done"], a["skipped"]) == (3, 2, 1)
    assert len(sent_a) == 2 and set(a["skipped_ids"]) == {0, 1, 2} - sent_a
    assert (b["planned"], b["done"], b["skipped"]) == (4, 4, 0)
    # resume: the budget is still spent, nothing is sent again, a/2 stays skipped
    again = run_generate(params, progress=False, model=ScriptedModel(), tokenizer=smollm2_tokenizer)
    assert again.new_records == 0 and sum(journaled(params).values()) == 6


def test_a_stop_while_a_budget_skips_still_finishes_the_rows_in_flight(tmp_path, smollm2_tokenizer):
    """STOP while the second pair of slots fills (a budget skip had to refill them): both rows in flight are
    journaled, the rest is skipped (never sent), and resume sends exactly the rest, in full decode steps."""
    datasets = [{"name": "a", "path": str(_prompt_file(tmp_path / "a.jsonl", 3, "Apple")), "token_budget": 1},
                {"name": "b", "path": str(_prompt_file(tmp_path / "b.jsonl", 4, "Berry"))}]
    over = {"output_root": str(tmp_path / "out"), "datasets": datasets, "generate.batch_size": 2}
    params = load_params(REPO / "params" / "ci.yaml", over)
    stop = params.run_dir / "STOP"
    model = ScriptedModel(lambda n: stop.touch() if n == 4 else None)  # while b/1 is prefilled
    s = run_generate(params, progress=False, model=model, tokenizer=smollm2_tokenizer)
    assert s.status == "stopped" and "STOP file" in s.stop_reason and s.new_records == 4
    assert model.calls == 4 and model.steps == [2] * 4
    led = assert_ledger_adds_up(params.run_dir)
    assert ledger_totals(led) == {"planned": 7, "done": 4, "skipped": 3}  # a/2 (budget), b/2 and b/3 (the stop)
    stop.unlink()
    again = ScriptedModel()
    s2 = run_generate(params, progress=False, model=again, tokenizer=smollm2_tokenizer)
    assert s2.status == "finished" and s2.new_records == 2 and again.calls == 2 and again.steps == [2, 2]
    keys = journaled(params)
    assert set(keys.values()) == {1} and len(keys) == 6 and sum(d == "b" for d, _ in keys) == 4


def test_sampling_goes_through_the_same_slots(tmp_path, smollm2_tokenizer):
    """temperature/top-k/top-p/min-p through transformers' warpers, two slots refilled: every row still gets
    its scripted ids (the stand-in puts all mass on them), so sampling keeps each row's cache and order."""
    over = {"output_root": str(tmp_path), "generate.batch_size": 2,
            "generate.sampling": {"max_new_tokens": 8, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05}}
    params = load_params(REPO / "params" / "ci.yaml", over)
    model = ScriptedModel()
    s = run_generate(params, progress=False, model=model, tokenizer=smollm2_tokenizer)
    assert s.status == "finished" and s.new_records == 4 and model.calls == 4 and model.steps == [2] * 4
    recs = [r for path in sorted((params.run_dir / "records").glob("*.jsonl")) for r in scan_journal(path).records]
    assert [r["output_ids"] for r in recs] == [[9, 10, SMOLLM2.end_of_turn.id]] * 4
    assert {r["finish_reason"] for r in recs} == {"stop"} and recs[0]["sampling"]["temperature"] == 0.7

def test_continuous_batching_gives_every_prompt_the_ids_of_sequential_greedy(smollm2_tokenizer):
    """Embedded SmolLM2, fp32 on CPU: prompts of the shipped datasets, short and long alternating, 3 slots, so
    rows join a batch padded for a longer row, pad it for themselves, and leave it at different steps, and a
prompt that shares its start with one prefilled before prefills only the rest;
    every prompt's output ids equal one greedy `model.generate` per prompt (cut at the first stop id)."""
    from eagle3data.core.models import load_model
    from eagle3data.core.params import SamplingParams
    from eagle3data.generate.backends.local import LocalBackend, cut_at_stop
    from eagle3data.prompts.files import builtin_datasets
    from eagle3data.prompts.load import load_prompts, template_prompt

    tok = smollm2_tokenizer
    model = load_model("embedded:smollm2")
    prompts = [p for n in builtin_datasets() for p in load_prompts(f"builtin:{n}").prompts]
    ids = sorted((template_prompt(tok, p, SMOLLM2) for p in prompts), key=len)
    picked = [ids[0], ids[-1], ids[1], ids[len(ids) // 2], ids[2], ids[-2], ids[3]]
    sampling = SamplingParams(max_new_tokens=20, temperature=0.0)
    backend = LocalBackend(model, tok, SMOLLM2, sampling, batch_size=3)
    todo = list(enumerate(picked))
    got = dict(backend.stream(lambda: todo.pop(0) if todo else None))
    with torch.inference_mode():
        for i, p in enumerate(picked):
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=20, do_sample=False, eos_token_id=SMOLLM2.stop_ids,
                                 pad_token_id=SMOLLM2.end_of_turn.id, temperature=None, top_p=None, top_k=None)
            want, stopped = cut_at_stop(out[0, len(p):].tolist(), SMOLLM2.stop_ids)
            assert got[i]["output_ids"] == want, f"prompt {i} ({len(p)} tokens)"
            assert got[i]["finish_reason"] == ("stop" if stopped else "length")
    assert max(map(len, picked)) > 4 * min(map(len, picked))  # the batch really was padded
    assert backend.reused > 0  # and prompts started from a stored prompt's cache (the two longest share ~500 ids)


def test_slots_and_stored_prefixes_keep_every_row_straight():
    """The scripted stand-in reads each row's prompt back from its own cache row: prompts that share long
    starts (a stored prompt's cache reused, up to all but the last id; one prompt twice), lengths from 3 to
    400 tokens in 3 slots (the window is copied into larger buffers, rows leave at different steps and the
    last rows move into their slots): every reply is the one its whole prompt scripts."""
    from eagle3data.core.params import SamplingParams
    from eagle3data.generate.backends.local import LocalBackend

    eot = SMOLLM2.end_of_turn.id

    def script(prompt):  # depends on every id of the prompt, and of a length that varies
        return [sum(i * t for i, t in enumerate(prompt, 1)) % 1000 + 10, len(prompt) + 10][: 1 + len(prompt) % 2] \
            + [7] * (len(prompt) % 5) + [eot]

    system = list(range(100, 140))
    prompts = [system + [1, 2, 3], system + [1, 2, 4], [5, 6, 7], system + [1, 2, 3], system + list(range(200, 560)),
               system + list(range(200, 560)) + [9], system + [1], list(range(300, 320)), system + [1, 2, 3, 8]]
    model = ScriptedLM(script, eot)
    backend = LocalBackend(model, None, SMOLLM2, SamplingParams(max_new_tokens=8, temperature=0.0), batch_size=3)
    todo = list(enumerate(prompts))
    got = list(backend.stream(lambda: todo.pop(0) if todo else None))
    assert sorted(i for i, _ in got) == list(range(len(prompts)))
    for i, res in got:
        assert res["output_ids"] == script(prompts[i])[:8], f"prompt {i}"
    assert model.prompts == prompts  # every prompt whole in its prefill cache, in the order pulled
    assert backend.reused >= 40 * 6 + 360  # the stored starts were used, never the whole prompt
    assert backend.slots.copies >= 2  # the window outgrew its buffer
