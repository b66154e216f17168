"""Benchmark verify-hidden against plain reading of the same store, in the same run; writes outputs/bench/verify.json.

Baseline: iterate the store through `HiddenReader` and turn every sample's states into float32
(the least a consumer does with them). Ours: `verify_store` without recompute (the head at its
default positions per sample, every per-sample figure, the ids and mask against the records).
Rounds alternate and the best of each counts (the CPU is shared). The verification's own split
(setup: records, mix, head tensors; head: the GEMMs; the rest: per-sample figures and the reading)
comes from its summary. Also measured: the recompute cost per sample (`--recompute all` minus
none, per sample), the cost per head position of this model's head and of a Kimi-sized head
(hidden 7168, vocab 163840) on this CPU with the verification's kernels (the Kimi one timed on a
tenth of the vocabulary and scaled: the matmul and the softmax are linear in it), and the sample
length from which the floors' head positions keep the verification at 0.5x plain reading.

Store: the embedded run's (`outputs/embedded/hidden`, from `make run`); without one, the nbval
fixture records are extracted once into outputs/bench/verify_run.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "bench"


def store_params():
    from eagle3data.core.params import load_params
    from eagle3data.core.provenance import params_of_run
    from eagle3data.hidden.extract import run_extract

    real = REPO / "outputs" / "embedded"
    if (real / "hidden" / "index.json").exists():
        return params_of_run(real), "outputs/embedded (make run)"
    root = OUT / "verify_run"
    p = load_params(REPO / "tests" / "fixtures" / "nbval.yaml",
                    {"output_root": str(root), "hidden.probe_batches": 0, "hidden.verify_after": False})
    if not (p.run_dir / "hidden" / "index.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(REPO / "tests" / "fixtures" / "runs" / "nbval" / "records", p.run_dir / "records")
        run_extract(p, progress=False)
    return p, "tests/fixtures/runs/nbval (extracted here)"


def plain_read(hdir: Path) -> int:
    from eagle3data.hidden.store import HiddenReader

    n = 0
    for smp in HiddenReader(hdir):
        n += smp["hidden_states"].float().shape[0]
    return n


def head_cost(positions: int = 512, vocab_part: int = 16384, hidden: int = 7168, vocab: int = 163840,
              rounds: int = 3) -> float:
    """Seconds per head position on this CPU (float32, the verification's own kernels: one GEMM of `positions`,
    log-softmax, argmax), timed on `vocab_part` rows of the vocabulary and scaled (each is linear in it)."""
    import torch

    w = torch.randn(min(vocab_part, vocab), hidden)
    x = torch.randn(positions, hidden)

    def once() -> None:
        logits = torch.nn.functional.linear(x, w)
        logits.argmax(1)
        torch.log_softmax(logits, dim=-1)

    once()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return best * (vocab / min(vocab_part, vocab)) / positions


def main() -> int:
    import torch

    from eagle3data.hidden.extract import load_config
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.store import HiddenReader, stored_bytes_per_token
    from eagle3data.hidden.verify import DEFAULT_POSITIONS, verify_store
    from eagle3data.hidden.verify_checks import HEAD_FLOPS_PER_BYTE, OUT_FLOOR, PROMPT_FLOOR
    from eagle3data.hidden.verify_run import BACKENDS

    load_start = os.getloadavg()
    p, where = store_params()
    hdir = hidden_dir(p)
    cfg = load_config(p)
    info = HiddenReader(hdir).info
    scratch = OUT / "verify_lines.jsonl"
    tokens = plain_read(hdir)  # warm the page cache for both sides
    base, ours, runs = [], [], []
    for _ in range(3):
        t0 = time.perf_counter()
        plain_read(hdir)
        base.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        res = verify_store(p, config=cfg, recompute=0, positions=DEFAULT_POSITIONS, out=scratch)
        ours.append(time.perf_counter() - t0)
        runs.append(res.summary)
    t0 = time.perf_counter()
    full = verify_store(p, config=cfg, backend=BACKENDS["hf"](p, info, cfg), recompute="all",
                        positions=DEFAULT_POSITIONS, out=scratch)
    with_all = time.perf_counter() - t0
    n = full.summary["samples"]
    best = min(range(3), key=lambda i: ours[i])
    s = runs[best]
    head = s["head"]
    hidden, vocab = int(cfg.get_text_config().hidden_size), int(cfg.get_text_config().vocab_size)
    this_head = head_cost(hidden=hidden, vocab=vocab, vocab_part=vocab)
    kimi = head_cost()
    token_bytes = stored_bytes_per_token(info)
    read_s_per_token = min(base) / tokens
    rest_s = min(ours) - s["setup_seconds"] - s["head_seconds"]  # the per-sample figures and the reading
    figures = {
        "store": where, "samples": n, "tokens": tokens, "bytes_per_token": token_bytes,
        "positions_cap": DEFAULT_POSITIONS, "out_floor": OUT_FLOOR, "prompt_floor": PROMPT_FLOOR,
        "head_flops_per_byte": HEAD_FLOPS_PER_BYTE, "head_positions": head,
        "plain_read_s": round(min(base), 4), "verify_s": round(min(ours), 4),
        "speed_vs_plain_read": round(min(base) / min(ours), 4), "goal": ">= 0.5",
        "speed_vs_plain_read_per_round": [round(b / o, 4) for b, o in zip(base, ours)],
        "verify_split_s": {"setup": s["setup_seconds"], "head": s["head_seconds"], "figures_and_reading": round(rest_s, 4)},
        "speed_vs_plain_read_without_head": round(min(base) / max(min(ours) - s["head_seconds"], 1e-9), 4),
        "verify_ok": bool(res.ok and full.ok),
        "recompute_s_per_sample": round((with_all - min(ours)) / n, 4),
        "recompute_s_per_sample_inside_verify": round(full.summary["recompute_seconds"] / n, 4),
        "recompute_over_verify_per_sample": round((with_all - min(ours)) / min(ours), 3),
        "recompute_tokens_per_s": round(tokens / max(full.summary["recompute_seconds"], 1e-9), 1),
        "head_ms_per_position_cpu": round(1e3 * this_head, 3),
        "kimi_head_ms_per_position_cpu": round(1e3 * kimi, 3),
        "kimi_over_this_head": round(kimi / this_head, 2),
        # at the floors, how long a sample must be (tokens) for verify to reach 0.5x plain reading on this CPU:
        # n * (stats per token) + floor positions * head per position <= 2 * n * read per token
        "tokens_per_sample_for_half_speed": _break_even(read_s_per_token, rest_s / tokens, this_head,
                                                        OUT_FLOOR + PROMPT_FLOOR),
        "power": power(p, cfg),
        "torch_threads": torch.get_num_threads(), "load_average_at_start": load_start,
        "load_average": os.getloadavg(),
        "rounds": {"plain_read_s": [round(x, 4) for x in base], "verify_s": [round(x, 4) for x in ours]},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "verify.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
    return 0


def power(p, cfg, draws: int = 20000) -> dict:
    """The detection power of the floors, from this store: every output and prompt position of each clean
    sample, of the sample shifted by one position, and of the sample with the next sample's states (the
    output part: a swap; the prompt part: a prompt from another sample), through the head.

    head_top1: the measured top-1 rates, and for the floor K the binomial false-fail (a clean sample at
    TOP1_CLEAN_MISS) and miss (a broken sample at BROKEN_TOP1 hits, above the worst measured) of top1_limit(K).
    prompt_logprob: K positions drawn (with replacement) `draws` times per sample; the worst sample's share
    below the limit (clean: a false failure) and at or above it (prompt from another sample: a miss)."""
    import torch

    from eagle3data.core.models import resolve_model_path
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.store import HiddenReader
    from eagle3data.hidden.verify_checks import (MIN_PROMPT_LOGPROB, OUT_FLOOR, PROMPT_FLOOR, TOP1_ALPHA,
                                                 TOP1_CLEAN_MISS, binom_tail, load_head, top1_limit)

    head = load_head(resolve_model_path(p.model.path), cfg)
    rd = HiddenReader(hidden_dir(p))
    fin = rd.states.index("post_norm") if "post_norm" in rd.states else rd.states.index("pre_norm")
    post_of = (lambda hs: hs[:, fin].float()) if rd.states[fin] == "post_norm" else (lambda hs: head.norm(hs[:, fin]))
    samples = list(rd)

    def figs(post, ids, at):
        if not at:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0)
        rows = torch.tensor(at, dtype=torch.long)
        logits = torch.nn.functional.linear(post[rows], head.lm_head)
        tgt = ids[rows + 1].long()
        return (logits.argmax(1) != tgt).long(), torch.log_softmax(logits, -1).gather(1, tgt[:, None])[:, 0]

    got: dict[str, list] = {"clean_out": [], "clean_prompt": [], "shift_out": [], "swap_out": [], "other_prompt": []}
    for i, smp in enumerate(samples):
        ids, m = smp["input_ids"], smp["loss_mask"].tolist()
        n = len(m)
        out_at = [t for t in range(n - 1) if m[t + 1]]
        prompt_at = [t for t in range(n - 1) if not m[t + 1]]
        post = post_of(smp["hidden_states"])
        got["clean_out"].append(figs(post, ids, out_at))
        got["clean_prompt"].append(figs(post, ids, prompt_at))
        got["shift_out"].append(figs(torch.roll(post, -1, 0), ids, out_at))
        other = post_of(samples[(i + 1) % len(samples)]["hidden_states"])
        k = min(len(other), n)
        mixed = post.clone()
        mixed[:k] = other[:k]
        got["swap_out"].append(figs(mixed, ids, [t for t in out_at if t < k]))
        got["other_prompt"].append(figs(mixed, ids, [t for t in prompt_at if t < k]))
    rates = {}
    for name, parts in got.items():
        miss = torch.cat([a for a, _ in parts])
        rates[name] = {"positions": len(miss), "top1": round(1 - float(miss.float().mean()), 4)}
    broken = 0.10
    measured_broken = max(rates["shift_out"]["top1"], rates["swap_out"]["top1"])
    lim = top1_limit(OUT_FLOOR)
    g = torch.Generator().manual_seed(0)

    def worst(parts, below: bool, k: int = PROMPT_FLOOR) -> float:
        out = 0.0
        for _, lp in parts:
            if len(lp) == 0:
                continue
            mean = lp[torch.randint(len(lp), (draws, k), generator=g)].mean(1)
            out = max(out, float(((mean < MIN_PROMPT_LOGPROB) if below else (mean >= MIN_PROMPT_LOGPROB)).float().mean()))
        return out

    return {"rates": rates, "head_top1": {
        "K": OUT_FLOOR, "fail_at_misses": lim, "clean_miss_rate_assumed": TOP1_CLEAN_MISS,
        "broken_top1_assumed": broken, "broken_top1_measured_worst": measured_broken,
        "false_fail": float(f"{binom_tail(OUT_FLOOR, TOP1_CLEAN_MISS, lim):.3g}"), "alpha": TOP1_ALPHA,
        "miss": float(f"{1 - binom_tail(OUT_FLOOR, 1 - broken, lim):.3g}"),
        "by_K": {k: {"fail_at_misses": top1_limit(k),
                     "false_fail": float(f"{binom_tail(k, TOP1_CLEAN_MISS, top1_limit(k)):.3g}"),
                     "miss": float(f"{1 - binom_tail(k, 1 - broken, top1_limit(k)):.3g}")} for k in (4, 8, 16, 32)}},
        "prompt_logprob": {"K": PROMPT_FLOOR, "limit": MIN_PROMPT_LOGPROB, "draws_per_sample": draws,
                           "worst_clean_false_fail": worst(got["clean_prompt"], True),
                           "worst_broken_miss": worst(got["other_prompt"], False),
                           "by_K": {k: {"worst_clean_false_fail": worst(got["clean_prompt"], True, k),
                                        "worst_broken_miss": worst(got["other_prompt"], False, k)}
                                    for k in (16, 32)}}}


def _break_even(read_tok: float, figures_tok: float, head_pos: float, positions: int) -> int | None:
    """Tokens per sample from which `positions` head positions per sample keep verify at >= 0.5x plain reading
    (None: the per-token figures alone cost more than twice the reading)."""
    spare = 2 * read_tok - figures_tok
    return None if spare <= 0 else int(positions * head_pos / spare) + 1


if __name__ == "__main__":
    raise SystemExit(main())
