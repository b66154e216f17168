"""Local generation throughput: the stage's batched backend vs sequential `model.generate`.

Same model, same prompts (the 25 shipped prompts), same greedy settings, in the same run.
Output tokens counted up to and including the stop token. Goal: ratio >= 3.
Writes outputs/bench/local_generate.json.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from eagle3data.backends.local import LocalBackend, cut_at_stop
from eagle3data.models import load_model, load_tokenizer
from eagle3data.params import SamplingParams, repo_root
from eagle3data.profiles import SMOLLM2
from eagle3data.prompts import builtin_datasets, load_prompts, template_prompt

MAX_NEW = int(os.environ.get("BENCH_MAX_NEW_TOKENS", "96"))
BATCH = 8


def main() -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    tok = load_tokenizer("embedded:smollm2", profile=SMOLLM2)
    model = load_model("embedded:smollm2")
    prompts = [p for n in builtin_datasets() for p in load_prompts(f"builtin:{n}").prompts]
    ids = [template_prompt(tok, p, SMOLLM2) for p in prompts]
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)

    # baseline: one prompt at a time
    t0 = time.perf_counter()
    seq_tokens = 0
    with torch.inference_mode():
        for p in ids:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=SMOLLM2.stop_ids,
                                 pad_token_id=SMOLLM2.end_of_turn.id, temperature=None, top_p=None, top_k=None)
            seq_tokens += len(cut_at_stop(out[0, len(p):].tolist(), SMOLLM2.stop_ids)[0])
    seq_s = time.perf_counter() - t0

    # the stage: batches of similar-length prompts
    backend = LocalBackend(model, tok, SMOLLM2, sampling, batch_size=BATCH)
    order = sorted(ids, key=len)
    t0 = time.perf_counter()
    bat_tokens = 0
    for i in range(0, len(order), BATCH):
        bat_tokens += sum(len(r["output_ids"]) for r in backend.generate_batch(order[i : i + BATCH]))
    bat_s = time.perf_counter() - t0

    res = {
        "bench": "local_generate",
        "model": "SmolLM2-135M-Instruct (embedded)",
        "prompts": len(ids), "max_new_tokens": MAX_NEW, "batch_size": BATCH, "threads": torch.get_num_threads(),
        "sequential": {"seconds": round(seq_s, 2), "output_tokens": seq_tokens, "tokens_per_s": round(seq_tokens / seq_s, 1)},
        "batched": {"seconds": round(bat_s, 2), "output_tokens": bat_tokens, "tokens_per_s": round(bat_tokens / bat_s, 1)},
    }
    res["ratio"] = round(res["batched"]["tokens_per_s"] / res["sequential"]["tokens_per_s"], 2)
    res["goal"] = ">= 3.0"
    res["met"] = res["ratio"] >= 3.0
    out = repo_root() / "outputs" / "bench" / "local_generate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
