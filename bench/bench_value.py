"""06's costs, in one run; writes outputs/bench/value.json.

1. Training throughput: our loop (`value.train.train_draft`: speculators' ArrowDataset, multipack sampler,
   collate and shift, forward + loss + backward, optimizer and schedule steps, progress line, train log,
   checkpoints) against speculators' model forward + backward alone on the same packed batches, collated
   beforehand (no data reading, no optimizer, no logging) -- the issue's row, goal >= 0.9x -- and against that
   model's forward + backward with speculators' own optimizers stepped after each (Muon + AdamW, its default: the
   work of a step that any loop around the model has to do, its Trainer's too), the row of what our loop itself
   adds (goal >= 0.9x). Tokens/s of each, the three alternated over rounds after one warm-up round of each (not
   counted: the first rounds of an earlier run warmed the baseline from 635 to 871 tokens/s while ours stayed
   flat), best of each; `optimizer_share_of_a_step` is what the optimizers' steps take of a step.
2. Engine evaluation: the time per prompt of the speculative server (the draft trained in 1) against the plain
   server on the same prompts (greedy, same length, same concurrency), serving time only (start-up apart).
   A figure on 2 CPU cores, not a goal.

The hand-off is the embedded run's (`make run`): its records through 04 in speculators' layout and 05, once,
into outputs/bench/value_run/.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "bench"
sys.path.insert(0, str(Path(__file__).parent))
from bench_hidden import ensure_records  # noqa: E402

STEPS = 16  # a run's fixed costs (its last checkpoint, save_pretrained) over 16 steps, as a real run's over ~90
ROUNDS = 4
WARMUP = 1  # rounds of each run first and not counted (allocator, thread pools, page cache of the hand-off)
SEQ = 1024


def handoff():
    from eagle3data.core.params import load_params
    from eagle3data.export import handoff as HO
    from eagle3data.hidden.extract import run_extract
    from eagle3data.hidden.mix import read_mix

    src = ensure_records()[0] / "embedded"  # (a folder holding embedded/records, where it came from)
    root = OUT / "value_run"
    p = load_params(REPO / "params" / "embedded.yaml", {"output_root": str(root), "run_name": "embedded",
                                                         "hidden.probe_batches": 0, "hidden.layout": "speculators",
                                                         "hidden.storage": "bf16", "export.draft_vocab_size": 8192})
    if not (p.run_dir / "export" / "speculators" / "handoff.json").exists():
        shutil.rmtree(p.run_dir, ignore_errors=True)
        shutil.copytree(src / "records", p.run_dir / "records")
        res = run_extract(p, progress=False)
        HO.write_handoff(p, read_mix(res.hidden_dir).samples, p.run_dir / "export" / "speculators", "speculators")
    return p


def model_alone(p, ids, rows, cfg, optimizers: bool = False) -> float:
    """speculators' forward + backward alone on the batches our loop trains on (the first STEPS of its epochs,
    collated before the clock starts); `optimizers`: and speculators' optimizers' steps after each (its default,
    Muon on the matrices + AdamW, with the linear schedule), the work of a step that any loop around it has to do."""
    import torch
    from speculators.losses import resolve_loss_config

    from eagle3data.generate.backends.vllm_server import model_dir  # the folder the engine serves
    from eagle3data.value.train import _loader, _optimizers, build_draft

    draft = build_draft(model_dir(p), p.run_dir / "export" / "speculators", ids, cfg)
    loader, sampler = _loader(p.run_dir / "export" / "speculators", rows, 576, cfg)
    batches, epoch = [], 0
    while len(batches) < STEPS:
        sampler.set_epoch(epoch)
        batches += list(loader)[:STEPS - len(batches)]
        epoch += 1
    opts, scheds = _optimizers(draft, cfg, STEPS) if optimizers else ([], [])
    lc = resolve_loss_config(cfg.loss_fn, "eager")
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    tokens, t0 = 0, time.perf_counter()
    for b in batches:
        inp = {k: b[k] for k in keys}
        inp["loss_mask"] = inp["loss_mask"].bool()
        _, loss, _ = draft(**inp, ttt_steps=cfg.ttt_steps, loss_config=lc)
        loss.backward()
        for o in opts:
            o.step()
        for sc in scheds:
            sc.step()
        draft.zero_grad(set_to_none=True)
        tokens += int((b["document_ids"] >= 0).sum())
    del torch
    return tokens / (time.perf_counter() - t0)


def ours(p, ids, rows, cfg, out: Path) -> tuple[float, Path]:
    from eagle3data.generate.backends.vllm_server import model_dir  # the folder the engine serves
    from eagle3data.value.train import train_draft

    shutil.rmtree(out, ignore_errors=True)
    res = train_draft(p.run_dir / "export" / "speculators", model_dir(p), ids, out, cfg, rows, say=lambda s: None)
    return res.train_tokens / res.seconds, res.draft_dir


def main() -> int:
    from eagle3data.core.params import VLLMServerParams
    from eagle3data.core.reader import read_run
    from eagle3data.value.engine import serve
    from eagle3data.value.train import TrainConfig, layer_ids_of_store

    load = os.getloadavg()
    p = handoff()
    ids = layer_ids_of_store(p.run_dir / "hidden")
    n = json.loads((p.run_dir / "export" / "speculators" / "handoff.json").read_text())["rows"]
    rows = list(range(n))
    cfg = TrainConfig(epochs=50, total_seq_len=SEQ, max_steps=STEPS)  # checkpoint_every as a run's: at the end
    ours_r, base_r, opt_r, draft = [], [], [], None
    for _ in range(WARMUP):
        model_alone(p, ids, rows, cfg)
        model_alone(p, ids, rows, cfg, optimizers=True)
        ours(p, ids, rows, cfg, OUT / "value_draft")
    for _ in range(ROUNDS):  # alternated: the CPU is shared
        base_r.append(model_alone(p, ids, rows, cfg))
        opt_r.append(model_alone(p, ids, rows, cfg, optimizers=True))
        rate, draft = ours(p, ids, rows, cfg, OUT / "value_draft")
        ours_r.append(rate)
    prompts = [r["prompt_ids"] for r in read_run(p.run_dir, rebuilt=False, verdicts=False).records()
               if r.get("prompt_ids")]
    srv = VLLMServerParams(port=0)
    plain, pinfo = serve(p, srv, prompts, 64, stage="bench_plain", say=lambda s: None)
    spec, sinfo = serve(p, srv, prompts, 64, stage="bench_spec", draft_dir=draft, k=3, say=lambda s: None)
    steps = sum(s.steps or 0 for s in spec)
    out = {"train_tokens_per_s": [round(x, 1) for x in ours_r], "model_alone_tokens_per_s": [round(x, 1) for x in base_r],
           "train_vs_model_alone": round(max(ours_r) / max(base_r), 3),
           "train_vs_model_alone_per_round": [round(a / b, 3) for a, b in zip(ours_r, base_r)],
           "model_and_optimizers_tokens_per_s": [round(x, 1) for x in opt_r],
           "train_vs_model_and_optimizers": round(max(ours_r) / max(opt_r), 3),
           "train_vs_model_and_optimizers_per_round": [round(a / b, 3) for a, b in zip(ours_r, opt_r)],
           "optimizer_share_of_a_step": round(1 - max(opt_r) / max(base_r), 3),
           "steps": STEPS, "warmup_rounds": WARMUP, "total_seq_len": SEQ, "prompts": len(prompts),
           "plain_s_per_prompt": round(pinfo["serve_s"] / len(prompts), 3),
           "spec_s_per_prompt": round(sinfo["serve_s"] / len(prompts), 3),
           "spec_vs_plain_time_per_prompt": round(sinfo["serve_s"] / pinfo["serve_s"], 3),
           "spec_tau": round(1 + sum(s.accepted or 0 for s in spec) / steps, 3) if steps else None,
           "lossless": [a.ids for a in spec] == [b.ids for b in plain],
           "start_s": {"plain": pinfo["start_s"], "spec": sinfo["start_s"]},
           "load_average_1_5_15": list(load)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "value.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
