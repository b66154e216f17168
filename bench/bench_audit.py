"""Benchmark 03_audit against a straightforward audit script, in the same run.

1. Structural checks on ids already in memory (synthetic Kimi-profile records, 200-8,000
   output tokens): tokens/s of `audit_table` (goal >= 600M tokens/s and >= 75x on 2 cores), and
   the same checks written as Python list operations per record (the baseline).
2. End to end from a JSONL journal (parse + all id checks): `read_journal` + `audit_table`
   against `json.loads` per line + the per-record list checks (goal >= 5x, the checks <= 10%
   of the parse). Both sides run
   in one process on one core (the reader parses the id lists as text with numpy and the
   rest of each line with orjson; no columnar copy is written or reused, so every timed
   run pays the full JSONL parse). `parse_seconds` / `checks_seconds` split our time.
3. The stage (`stage`): `run_audit` on a run at the seeds' shape (2,000 Qwen3 API records of
   ~2,400 tokens with reasoning, ids from 02's `reconstruct/`, read `audit.chunk_records` at a
   time), every check included, against the one thing it cannot avoid: `tokenizers`' batch
   decode->encode of the same outputs (`text.roundtrip`), measured in the same run, both using
   every core (goal >= 0.5x: `rate_vs_floor`).

Each figure is measured in `BENCH_AUDIT_ROUNDS` (5) paired rounds (both sides in each round);
the headline is best against best, `speedup_per_round` the spread `make bench` compares with.
The machine's load average is recorded beside the figures: other work on the 2 cores slows
both sides, so compare ratios, not seconds, across runs. `BENCH_AUDIT_SLOW_CHECK=NAME` plants
a slowdown (the audit's check function NAME runs twice) to see the comparison flag it.

Writes `outputs/bench/audit.json`. Run: `.venv/bin/python bench/bench_audit.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lib"))

import eagle3data.audit.run as audit_run  # noqa: E402  (its module: a planted slowdown patches a check there)
from eagle3data.audit.idtable import read_journal  # noqa: E402
from eagle3data.core.profiles import KIMI_K25  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-only stand-in vocabulary
from synthetic import synthetic_id_table, synthetic_records  # noqa: E402

P = KIMI_K25
EOT, GUARD = P.end_of_turn.id, P.guard.id
OPEN, CLOSE = P.reasoning_open.id, P.reasoning_close.id
TC = P.tool_calls
SB, SE, CB, AB, CE = TC.section_begin.id, TC.section_end.id, TC.call_begin.id, TC.argument_begin.id, TC.call_end.id
TOOL = {SB, SE, CB, AB, CE}
NEXT = {None: {SB}, SB: {CB}, CB: {AB}, AB: {CE}, CE: {CB, SE}, SE: {SB}}


def naive_checks(records: list[dict]) -> list[list[str]]:
    """The ad-hoc audit script: Python list operations per record."""
    seen, outputs, fails = set(), {}, []
    for r in records:
        ids, f = r["output_ids"], []
        trunc = r["finish_reason"] == "length"
        if not trunc and not (ids and (ids[-1] == EOT or (ids[-1] == GUARD and len(ids) > 1 and ids[-2] == EOT))):
            f.append("ends_with_eot")
        n_eot, n_close = ids.count(EOT), ids.count(CLOSE)
        if n_eot != (0 if trunc else 1):
            f.append("single_eot")
        if n_close != 1 and not (trunc and n_close == 0):
            f.append("single_close")
        if n_close and n_eot and ids.index(CLOSE) > ids.index(EOT):
            f.append("close_before_eot")
        if OPEN in ids:
            f.append("no_open")
        if n_close and ids.index(CLOSE) == 0:
            f.append("reasoning_nonempty")
        if n_close and not trunc:
            end = ids.index(EOT) if n_eot else len(ids)
            if end - ids.index(CLOSE) - 1 <= 0:
                f.append("answer_nonempty")
        prev, ok = None, True
        close_at = ids.index(CLOSE) if n_close else -1
        for j, t in enumerate(ids):
            if t in TOOL:
                ok &= t in NEXT[prev]
                prev = t
                if j < close_at:
                    f.append("tool_inside_reasoning")
        if not ok or (prev not in (None, SE) and not trunc):
            f.append("tool_calls_balanced")
        if min(ids) < 0 or max(ids) >= P.vocab_size:
            f.append("ids_in_vocab")
        key = (r["dataset"], str(r["sample_id"]))
        if key in seen:
            f.append("unique_sample_id")
        seen.add(key)
        outputs.setdefault(tuple(ids), set()).add(tuple(r["prompt_ids"]))
        fails.append(f)
    return fails


def best_of(fn, k: int = 3) -> float:
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def slowed(name: str) -> None:
    """Plant a slowdown: the check function `name` of the audit (as `audit_table` calls it) runs twice.

    `BENCH_AUDIT_SLOW_CHECK=structural_checks make bench` shows what `make bench`'s comparison
    with the committed summary prints when one check costs twice what it did."""
    fn = getattr(audit_run, name)

    def twice(*args, **kwargs):
        fn(*args, **kwargs)
        return fn(*args, **kwargs)

    setattr(audit_run, name, twice)


def in_memory(n_mem: int, rounds: int) -> dict:
    """audit_table on ids in memory against the per-record list checks, `rounds` paired rounds."""
    t0 = time.perf_counter()
    table = synthetic_id_table(n_mem, seed=0)
    tokens = int(len(table.output))
    print(f"in memory: {n_mem} records, {tokens / 1e6:.1f}M output tokens (built in {time.perf_counter() - t0:.1f} s)")
    res = audit_run.audit_table(table, P)
    assert not any(res.failed_lists()), "synthetic records must be clean"
    sub = min(1500, n_mem)  # the baseline on a slice of the same records, per token
    lists = [{"dataset": "synthetic", "sample_id": i, "finish_reason": "stop",
              "output_ids": table.output_ids(i).tolist(), "prompt_ids": table.prompt_ids(i).tolist()}
             for i in range(sub)]
    sub_tokens = sum(len(r["output_ids"]) for r in lists)
    t_vec, t_base = [], []
    for _ in range(rounds):  # paired rounds: both sides see the same load
        t_vec.append(best_of(lambda: audit_run.audit_table(table, P), 3))
        t_base.append(best_of(lambda: naive_checks(lists), 1))
    vec_tps, base_tps = tokens / min(t_vec), sub_tokens / min(t_base)
    per_round = [round((tokens / v) / (sub_tokens / b), 2) for v, b in zip(t_vec, t_base)]
    print(f"  vectorized {vec_tps / 1e6:.0f}M tok/s, python lists {base_tps / 1e6:.1f}M tok/s "
          f"({vec_tps / base_tps:.0f}x; rounds {per_round})")
    return {"records": n_mem, "output_tokens": tokens, "seconds": round(min(t_vec), 4),
            "tokens_per_s": round(vec_tps), "baseline_tokens_per_s": round(base_tps),
            "speedup_vs_python_lists": round(vec_tps / base_tps, 1), "speedup_per_round": per_round,
            "goal_tokens_per_s": 600_000_000, "goal_speedup": 75.0,
            "goal_met": bool(vec_tps >= 6e8 and vec_tps / base_tps >= 75)}


def end_to_end(n_j: int, rounds: int, work: Path) -> dict:
    """read_journal + audit_table from a JSONL file against json.loads per line + the list checks."""
    t0 = time.perf_counter()
    recs = synthetic_records(n_j, seed=1, tool_share=0.25)
    path = work / "journal.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    j_tokens = sum(len(r["output_ids"]) for r in recs)
    mb = path.stat().st_size / 2**20
    del recs
    print(f"journal: {n_j} records, {j_tokens / 1e6:.1f}M output tokens, {mb:.0f} MiB "
          f"(built in {time.perf_counter() - t0:.1f} s)")

    def ours():
        return audit_run.audit_table(read_journal(path), P)

    def baseline():
        with open(path, encoding="utf-8") as f:
            rs = [json.loads(line) for line in f]
        return naive_checks(rs)

    r = ours()
    assert len(r.meta) == n_j and not any(r.failed_lists())
    assert not any(baseline())
    t_ours, t_naive = [], []
    for _ in range(rounds):
        t_ours.append(best_of(ours, 1))
        t_naive.append(best_of(baseline, 1))
    t_parse = best_of(lambda: read_journal(path), 3)
    table = read_journal(path)
    t_checks = best_of(lambda: audit_run.audit_table(table, P), 3)
    path.unlink()
    speedup = min(t_naive) / min(t_ours)
    per_round = [round(b / o, 2) for o, b in zip(t_ours, t_naive)]
    print(f"  ours {min(t_ours):.2f} s (parse {t_parse:.3f} + checks {t_checks:.3f}), json.loads + lists "
          f"{min(t_naive):.2f} s ({speedup:.1f}x; rounds {per_round})")
    return {"what": "read_journal + audit_table from the JSONL file, every run (no columnar copy), one process",
            "records": n_j, "output_tokens": j_tokens, "file_mib": round(mb, 1),
            "seconds": round(min(t_ours), 3), "parse_seconds": round(t_parse, 3), "checks_seconds": round(t_checks, 3),
            "checks_over_parse": round(t_checks / t_parse, 3), "baseline_seconds": round(min(t_naive), 3),
            "tokens_per_s": round(j_tokens / min(t_ours)), "baseline_tokens_per_s": round(j_tokens / min(t_naive)),
            "speedup": round(speedup, 1), "speedup_per_round": per_round, "goal_speedup": 5.0,
            "goal_checks_over_parse": 0.1, "goal_met": bool(speedup >= 5 and t_checks / t_parse <= 0.1)}


def _stage_run(n: int, run_dir: Path, tok) -> tuple[list[list[int]], int]:
    """A run at the seeds' shape: n Qwen3 API records over 8 datasets (replies of ~2,400 tokens with reasoning, a
    quarter with a tool, half with a system prompt), `output_ids: null` in the journal and 02's rebuilt ids in
    `reconstruct/`. Returns the outputs' ids (the floor's input) and the prompt tokens."""
    from eagle3data.core.profiles import QWEN3
    from eagle3data.core.spans import output_texts_batch
    from eagle3data.prompts.load import Prompt, template_prompts

    rng = np.random.default_rng(0)
    words = [w[1:] for w in tok.get_vocab() if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower()
             and len(w) > 3][:6000]
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look something up.",
                                                 "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    prompts, bodies = [], []
    for i in range(n):
        ds = f"b{i % 8 + 1}_scale"
        msgs = ([{"role": "system", "content": "You are a careful assistant."}] if i % 2 else []) + [
            {"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(20, 200)))) + f" (case {i})"}]
        prompts.append(Prompt(ds, i, msgs, tools if i % 4 == 0 else None))
        k = int(np.exp(rng.uniform(np.log(600), np.log(6000))))  # ~2,300 words on average: ~2,400 tokens
        r = int(k * 0.7)
        bodies.append(("\n" + " ".join(rng.choice(words, r)) + "\n", "\n\n" + " ".join(rng.choice(words, k - r))))
    prompt_ids = template_prompts(tok, prompts, QWEN3)
    texts = [b for pair in bodies for b in pair]
    enc = tok(texts, add_special_tokens=False)["input_ids"]
    outs = [[QWEN3.reasoning_open.id] + enc[2 * j] + [QWEN3.reasoning_close.id] + enc[2 * j + 1] + [QWEN3.end_of_turn.id]
            for j in range(n)]
    fields = output_texts_batch(outs, QWEN3, tok)
    journals: dict[str, list[bytes]] = {}
    rebuilt: dict[str, list[bytes]] = {}
    for p, pid, out, f in zip(prompts, prompt_ids, outs, fields):
        journals.setdefault(p.dataset, []).append(orjson.dumps({
            "dataset": p.dataset, "sample_id": p.sample_id, "source": "api", "model": "qwen3-scale", "profile": "qwen3",
            "messages": p.messages, "tools": p.tools, "prompt_ids": pid, "output_ids": None, "ids_exact": False,
            "reasoning": f.reasoning, "content": f.content, "tool_calls": f.tool_calls, "finish_reason": "stop",
            "usage": {"prompt_tokens": len(pid), "completion_tokens": len(out)}, "provider": "Loopback"}) + b"\n")
        rebuilt.setdefault(p.dataset, []).append(orjson.dumps({
            "dataset": p.dataset, "sample_id": p.sample_id, "source": "api", "provider": "Loopback", "ids_exact": False,
            "proof_level": "text", "prompt_ids": pid, "output_ids": out, "input_ids": pid + out,
            "loss_mask": [0] * len(pid) + [1] * len(out), "finish_reason": "stop"}) + b"\n")
    for sub, files in (("records", journals), ("reconstruct", rebuilt)):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
        for ds, lines in files.items():
            (run_dir / sub / f"{ds}.jsonl").write_bytes(b"".join(lines))
    return outs, sum(map(len, prompt_ids))


def stage(n: int, rounds: int, work: Path) -> dict:
    """`run_audit` on a run at the seeds' shape against `tokenizers`' batch decode->encode of the same outputs (the
    floor: what `text.roundtrip` alone must do), both in each round, on all cores (the tokenizer's threads)."""
    from eagle3data.core.params import load_params
    from qwen3_vocab import load_qwen3_tokenizer  # the tests' real Qwen3 vocabulary (tests/ is on the path)

    tok = load_qwen3_tokenizer()
    bt = tok.backend_tokenizer
    run_dir = work / "stage"
    t0 = time.perf_counter()
    outs, prompt_tokens = _stage_run(n, run_dir, tok)
    tokens = sum(map(len, outs))
    print(f"stage: {n} Qwen3 API records, {tokens / 1e6:.1f}M output tokens (built in {time.perf_counter() - t0:.1f} s)")
    params = load_params(REPO / "params" / "ci.yaml", {"output_root": str(work), "run_name": "stage", "profile": "qwen3"})
    chunk = params.audit.chunk_records

    def floor() -> None:
        for a in range(0, len(outs), chunk):
            bt.encode_batch(bt.decode_batch(outs[a : a + chunk], skip_special_tokens=False), add_special_tokens=False)

    res = audit_run.run_audit(params, progress=False, tokenizer=tok)
    s = res.summary()
    assert s["records"] == n and s["output_tokens"] == tokens and s["checks"]["text.roundtrip"]["applicable"] == n
    t_audit, t_floor = [], []
    for _ in range(rounds):  # paired rounds: both sides see the same load
        t_audit.append(best_of(lambda: audit_run.run_audit(params, progress=False, tokenizer=tok), 1))
        t_floor.append(best_of(floor, 1))
    shutil.rmtree(run_dir)
    ratio = min(t_floor) / min(t_audit)
    per_round = [round(f / a, 3) for a, f in zip(t_audit, t_floor)]
    print(f"  run_audit {tokens / min(t_audit) / 1e3:.0f}k tok/s, batch decode->encode {tokens / min(t_floor) / 1e3:.0f}k "
          f"tok/s ({ratio:.2f}x; rounds {per_round})")
    return {"what": "run_audit (every check, the tokenizer's included, the report's facts) against tokenizers' "
                    "decode_batch -> encode_batch of the same outputs, chunk_records at a time",
            "records": n, "output_tokens": tokens, "prompt_tokens": prompt_tokens, "chunk_records": chunk,
            "audit_seconds": round(min(t_audit), 2), "floor_seconds": round(min(t_floor), 2),
            "audit_tokens_per_s": round(tokens / min(t_audit)), "floor_tokens_per_s": round(tokens / min(t_floor)),
            "rate_vs_floor": round(ratio, 3), "rate_vs_floor_per_round": per_round, "goal_rate_vs_floor": 0.5,
            "goal_met": bool(ratio >= 0.5)}


def main() -> None:
    out_dir = Path(os.environ.get("BENCH_OUT", REPO / "outputs" / "bench"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "audit_tmp"
    work.mkdir(exist_ok=True)
    rounds = int(os.environ.get("BENCH_AUDIT_ROUNDS", 5))
    figures: dict = {"cpus": os.cpu_count(), "load_avg_1_5_15_at_start": [round(x, 2) for x in os.getloadavg()],
                     "profile": P.name, "output_lengths": "log-uniform 200-8000", "rounds": rounds}
    if os.environ.get("BENCH_AUDIT_SLOW_CHECK"):
        slowed(os.environ["BENCH_AUDIT_SLOW_CHECK"])
        figures["planted_slowdown"] = f"{os.environ['BENCH_AUDIT_SLOW_CHECK']} runs twice"
        print(f"PLANTED: {figures['planted_slowdown']}")
    figures["in_memory"] = in_memory(int(os.environ.get("BENCH_AUDIT_RECORDS", 30000)), rounds)
    figures["end_to_end_jsonl"] = end_to_end(int(os.environ.get("BENCH_AUDIT_JOURNAL_RECORDS", 2500)), rounds, work)
    figures["stage"] = stage(int(os.environ.get("BENCH_AUDIT_STAGE_RECORDS", 2000)),
                             int(os.environ.get("BENCH_AUDIT_STAGE_ROUNDS", 3)), work)
    shutil.rmtree(work)
    figures["load_avg_1_5_15_at_end"] = [round(x, 2) for x in os.getloadavg()]
    (out_dir / "audit.json").write_text(json.dumps(figures, indent=2))
    print(f"wrote {out_dir / 'audit.json'}")


if __name__ == "__main__":
    main()
