"""Benchmark verify-hidden against plain reading of the same store, in the same run; writes outputs/bench/verify.json.

Baseline: iterate the store through `HiddenReader` and turn every sample's states into float32
(the least a consumer does with them). Ours: `verify_store` without recompute (the head at its
default positions per sample, every per-sample figure, the ids and mask against the records).
Rounds alternate and the best of each counts (the CPU is shared). Also measured: the recompute
cost per sample (`--recompute all` minus none, per sample) and the cost per head position of a
Kimi-sized head (hidden 7168, vocab 163840) on this CPU, timed on a tenth of the vocabulary and
scaled (the matmul and the softmax are linear in the vocabulary).

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


def kimi_head_cost(positions: int = 64, vocab_part: int = 16384, hidden: int = 7168, vocab: int = 163840) -> float:
    """Seconds per head position of a Kimi-sized head on this CPU (float32), from a slice of the vocabulary."""
    import torch

    w = torch.randn(vocab_part, hidden)
    x = torch.randn(positions, hidden)
    torch.log_softmax(x @ w.T, dim=-1)  # warm-up
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.log_softmax(x @ w.T, dim=-1)
        best = min(best, time.perf_counter() - t0)
    return best * (vocab / vocab_part) / positions


def main() -> int:
    import torch

    from eagle3data.hidden.extract import load_config
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.store import HiddenReader
    from eagle3data.hidden.verify import DEFAULT_POSITIONS, verify_store
    from eagle3data.hidden.verify_run import BACKENDS

    p, where = store_params()
    hdir = hidden_dir(p)
    cfg = load_config(p)
    info = HiddenReader(hdir).info
    scratch = OUT / "verify_lines.jsonl"
    tokens = plain_read(hdir)  # warm the page cache for both sides
    base, ours = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        plain_read(hdir)
        base.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        res = verify_store(p, config=cfg, recompute=0, positions=DEFAULT_POSITIONS, out=scratch)
        ours.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    full = verify_store(p, config=cfg, backend=BACKENDS["hf"](p, info, cfg), recompute="all",
                        positions=DEFAULT_POSITIONS, out=scratch)
    with_all = time.perf_counter() - t0
    n = full.summary["samples"]
    figures = {
        "store": where, "samples": n, "tokens": tokens, "positions_per_sample": DEFAULT_POSITIONS,
        "plain_read_s": round(min(base), 4), "verify_s": round(min(ours), 4),
        "speed_vs_plain_read": round(min(base) / min(ours), 3), "goal": ">= 0.5",
        "verify_ok": bool(res.ok and full.ok),
        "recompute_s_per_sample": round((with_all - min(ours)) / n, 4),
        "recompute_s_per_sample_inside_verify": round(full.summary["recompute_seconds"] / n, 4),
        "recompute_tokens_per_s": round(tokens / max(full.summary["recompute_seconds"], 1e-9), 1),
        "kimi_head_ms_per_position_cpu": round(1e3 * kimi_head_cost(), 3),
        "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "rounds": {"plain_read_s": [round(x, 4) for x in base], "verify_s": [round(x, 4) for x in ours]},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "verify.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
