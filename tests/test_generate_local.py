"""01_generate local backend: a graceful stop between batches, a second signal drops the batch in
progress, and a resumed run finishes every sample exactly once.

The model is a scripted stand-in (fixed output ids, a hook per `generate` call) so each stop
lands at a known batch; the embedded SmolLM2 run itself is covered by `ci_run` and the notebooks.
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

REPO = Path(__file__).resolve().parents[1]


class ScriptedModel(torch.nn.Module):
    """Answers every prompt with the same three ids (the last one end-of-turn); calls `hook(n)` first."""

    def __init__(self, hook=lambda n: None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # generate_batch asks for the device
        self.calls = 0
        self.hook = hook

    def generate(self, input_ids, attention_mask, **kw):
        self.calls += 1
        self.hook(self.calls)
        out = torch.tensor([[9, 10, SMOLLM2.end_of_turn.id]] * input_ids.shape[0])
        return torch.cat([input_ids, out], dim=1)


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
    assert model.calls == 2 and s.new_records == 2  # the batch in progress was finished and journaled
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


class BatchLog(ScriptedModel):
    """A ScriptedModel that keeps each batch's prompts (decoded), to see what went into which batch."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tok, self.batches = tokenizer, []

    def generate(self, input_ids, attention_mask, **kw):
        self.batches.append([self.tok.decode(row[m.bool()].tolist()) for row, m in zip(input_ids, attention_mask)])
        return super().generate(input_ids, attention_mask, **kw)


def _prompt_file(path: Path, n: int, word: str) -> Path:
    """n one-turn prompts (one letter differs), sample ids 0..n-1."""
    import orjson

    rows = [orjson.dumps({"sample_id": i, "messages": [{"role": "user", "content": f"{word} {'abcdefgh'[i]}?"}]})
            for i in range(n)]
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


def test_batches_stay_full_when_a_budget_skips_prompts(tmp_path, smollm2_tokenizer):
    """One batch loop: a prompt whose dataset reached its budget leaves its place in the batch to the next
    prompt. `a` (budget 1 token) is cut after its first batch, as before: two records of `a` (the first
    batch is always sent), the third skipped; `b`'s four prompts then fill two batches of two. (The loop
    that kept fixed slices of the queue cut the same records but sent batches of 2, 1, 2, 1.)"""
    datasets = [{"name": "a", "path": str(_prompt_file(tmp_path / "a.jsonl", 3, "Apple")), "token_budget": 1},
                {"name": "b", "path": str(_prompt_file(tmp_path / "b.jsonl", 4, "Berry"))}]
    params = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path / "out"), "datasets": datasets,
                                                       "generate.batch_size": 2})
    model = BatchLog(smollm2_tokenizer)
    s = run_generate(params, progress=False, model=model, tokenizer=smollm2_tokenizer)
    assert s.status == "finished" and s.new_records == 6
    assert [len(b) for b in model.batches] == [2, 2, 2]  # full batches: the skipped a/2 left no hole
    which = [["Apple" if "Apple" in p else "Berry" for p in b] for b in model.batches]
    assert which == [["Apple", "Apple"], ["Berry", "Berry"], ["Berry", "Berry"]]
    keys = journaled(params)
    assert set(keys.values()) == {1} and len(keys) == 6
    sent_a = {sid for d, sid in keys if d == "a"}
    led = assert_ledger_adds_up(params.run_dir)
    a, b = led["datasets"]["a"], led["datasets"]["b"]
    assert a["budget_reached"] and (a["planned"], a["done"], a["skipped"]) == (3, 2, 1)
    assert len(sent_a) == 2 and set(a["skipped_ids"]) == {0, 1, 2} - sent_a
    assert (b["planned"], b["done"], b["skipped"]) == (4, 4, 0)
    # resume: the budget is still spent, nothing is sent again, a/2 stays skipped
    again = run_generate(params, progress=False, model=BatchLog(smollm2_tokenizer), tokenizer=smollm2_tokenizer)
    assert again.new_records == 0 and sum(journaled(params).values()) == 6


def test_a_stop_while_a_budget_skips_still_finishes_the_batch(tmp_path, smollm2_tokenizer):
    """STOP during the second batch (which a budget skip had to refill): that batch is journaled whole, the
    rest is skipped (never sent), and resume sends exactly the rest, in full batches."""
    datasets = [{"name": "a", "path": str(_prompt_file(tmp_path / "a.jsonl", 3, "Apple")), "token_budget": 1},
                {"name": "b", "path": str(_prompt_file(tmp_path / "b.jsonl", 4, "Berry"))}]
    over = {"output_root": str(tmp_path / "out"), "datasets": datasets, "generate.batch_size": 2}
    params = load_params(REPO / "params" / "ci.yaml", over)
    stop = params.run_dir / "STOP"
    model = BatchLog(smollm2_tokenizer)
    model.hook = lambda n: stop.touch() if n == 2 else None
    s = run_generate(params, progress=False, model=model, tokenizer=smollm2_tokenizer)
    assert s.status == "stopped" and "STOP file" in s.stop_reason and s.new_records == 4
    assert [len(b) for b in model.batches] == [2, 2]
    led = assert_ledger_adds_up(params.run_dir)
    assert ledger_totals(led) == {"planned": 7, "done": 4, "skipped": 3}  # a/2 (budget), b/2 and b/3 (the stop)
    stop.unlink()
    again = BatchLog(smollm2_tokenizer)
    s2 = run_generate(params, progress=False, model=again, tokenizer=smollm2_tokenizer)
    assert s2.status == "finished" and s2.new_records == 2 and [len(b) for b in again.batches] == [2]
    keys = journaled(params)
    assert set(keys.values()) == {1} and len(keys) == 6 and sum(d == "b" for d, _ in keys) == 4
