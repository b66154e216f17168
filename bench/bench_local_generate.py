"""Local generation throughput: the stage's continuous-batching backend vs sequential `model.generate`.

Same model, same prompts (the 25 shipped prompts), same greedy settings, in the same run. Output
tokens counted up to and including the stop token. The prompts are sorted by length as the stage
queues them. `ratio` is the stage's way: the whole queue through `LocalBackend.stream` (8 slots,
refilled as rows finish), timed in the middle of the run, over sequential (one `model.generate` per
prompt, all 25). `per_batch`: the queue cut into groups of 8, each group through both sides back to
back (order alternating from group to group, so a load change on this shared machine hits both
alike): the gain within a group, where the last rows of a group have no prompt to refill from.
`continuous_prefill`: prompt tokens of the whole queue, those taken from a stored prompt's
cache instead of prefilled, and how often the slot cache's window was copied into a new buffer.
Also measured: one decode step at batch 1 and at batch 8 (KV cache of 200 tokens), whose ratio
bounds what batching can gain here. Every prompt's ids must equal sequential greedy's on both
continuous runs. Goal: ratio >= 3. Writes outputs/bench/local_generate.json.
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from eagle3data.generate.backends.local import LocalBackend, cut_at_stop
from eagle3data.core.models import load_model, load_tokenizer
from eagle3data.core.params import SamplingParams, repo_root
from eagle3data.core.profiles import SMOLLM2
from eagle3data.prompts.load import load_prompts, template_prompt
from eagle3data.prompts.files import builtin_datasets

MAX_NEW = int(os.environ.get("BENCH_MAX_NEW_TOKENS", "96"))
BATCH = 8


def sequential(model, prompts: list[list[int]]) -> list[list[int]]:
    """Output ids of one `model.generate` per prompt (greedy, cut at the first stop id)."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=SMOLLM2.stop_ids,
                                 pad_token_id=SMOLLM2.end_of_turn.id, temperature=None, top_p=None, top_k=None)
            outs.append(cut_at_stop(out[0, len(p):].tolist(), SMOLLM2.stop_ids)[0])
    return outs


def continuous(backend: LocalBackend, prompts: list[list[int]]) -> list[list[int]]:
    """Output ids of the stage's backend over these prompts in this order (continuous batching)."""
    todo = list(enumerate(prompts))
    got = dict(backend.stream(lambda: todo.pop(0) if todo else None))
    return [got[i]["output_ids"] for i in range(len(prompts))]


def decode_step_ms(model, batch: int, context: int = 200, steps: int = 8) -> float:
    """Milliseconds of one cached decode step at this batch size (what batching can amortize)."""
    x = torch.randint(100, 1000, (batch, context))
    with torch.inference_mode():
        cache = model(x, use_cache=True).past_key_values
        nxt = torch.randint(100, 1000, (batch, 1))
        model(nxt, past_key_values=cache, use_cache=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            cache = model(nxt, past_key_values=cache, use_cache=True).past_key_values
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    tok = load_tokenizer("embedded:smollm2", profile=SMOLLM2)
    model = load_model("embedded:smollm2")
    prompts = [p for n in builtin_datasets() for p in load_prompts(f"builtin:{n}").prompts]
    ids = sorted((template_prompt(tok, p, SMOLLM2) for p in prompts), key=len)  # as the stage batches them
    backend = LocalBackend(model, tok, SMOLLM2, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
                           batch_size=BATCH)
    load_before = os.getloadavg()[0]
    sequential(model, ids[:1])  # warm-up, both paths
    continuous(backend, ids[:2])

    groups, seq_ids, whole = [], [], {}
    for g, lo in enumerate(range(0, len(ids), BATCH)):
        chunk = ids[lo : lo + BATCH]
        row = {"prompts": len(chunk), "prompt_tokens": [len(p) for p in chunk]}

        def seq(row=row, chunk=chunk):
            t0 = time.perf_counter()
            row["seq_ids"] = sequential(model, chunk)
            row["seq_s"] = time.perf_counter() - t0

        def bat(row=row, chunk=chunk):
            t0 = time.perf_counter()
            row["bat_ids"] = continuous(backend, chunk)
            row["bat_s"] = time.perf_counter() - t0

        for fn in ((seq, bat) if g % 2 == 0 else (bat, seq)):  # alternate which side goes first
            fn()
        seq_ids += row["seq_ids"]
        row["ids_equal"] = row["seq_ids"] == row["bat_ids"]
        row["seq_tokens"] = sum(map(len, row.pop("seq_ids")))
        row["bat_tokens"] = sum(map(len, row.pop("bat_ids")))
        groups.append(row)
        print(f"group {g}: {row['prompts']} prompts, seq {row['seq_s']:.1f} s, continuous {row['bat_s']:.1f} s, "
              f"{row['seq_tokens']} tokens, ids equal {row['ids_equal']}, load {os.getloadavg()[0]:.1f}", flush=True)
        if g == 1:  # the whole queue in the middle of the run
            t0 = time.perf_counter()
            whole["ids"] = continuous(backend, ids)
            whole["s"] = time.perf_counter() - t0
            whole["reused"], whole["copies"] = backend.reused, backend.slots.copies
            print(f"whole queue: continuous {whole['s']:.1f} s, {sum(map(len, whole['ids']))} tokens", flush=True)

    seq_s, bat_s = sum(r["seq_s"] for r in groups), sum(r["bat_s"] for r in groups)
    seq_tok, bat_tok = sum(r["seq_tokens"] for r in groups), sum(r["bat_tokens"] for r in groups)
    whole_tok = sum(map(len, whole["ids"]))
    step1, step8 = decode_step_ms(model, 1), decode_step_ms(model, BATCH)
    res = {
        "bench": "local_generate",
        "model": "SmolLM2-135M-Instruct (embedded)",
        "prompts": len(ids), "max_new_tokens": MAX_NEW, "batch_size": BATCH, "threads": torch.get_num_threads(),
        "load_average_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "sequential": {"seconds": round(seq_s, 2), "output_tokens": seq_tok, "tokens_per_s": round(seq_tok / seq_s, 1)},
        "continuous": {"seconds": round(whole["s"], 2), "output_tokens": whole_tok,
                       "tokens_per_s": round(whole_tok / whole["s"], 1)},
        "continuous_prefill": {"prompt_tokens": sum(map(len, ids)), "reused_from_stored_prefix": whole["reused"],
                               "window_copies": whole["copies"]},
        "continuous_per_group": {"seconds": round(bat_s, 2), "output_tokens": bat_tok,
                                 "tokens_per_s": round(bat_tok / bat_s, 1), "ratio": round((bat_tok / bat_s) / (seq_tok / seq_s), 2)},
        "ids_equal": whole["ids"] == seq_ids and all(r["ids_equal"] for r in groups),
        "prompts_with_other_ids": [i for i, (a, b) in enumerate(zip(whole["ids"], seq_ids)) if a != b],
        "per_batch": [{**r, "seq_s": round(r["seq_s"], 2), "bat_s": round(r["bat_s"], 2),
                       "ratio": round((r["bat_tokens"] / r["bat_s"]) / (r["seq_tokens"] / r["seq_s"]), 2)}
                      for r in groups],
        "decode_step_ms": {"batch_1": round(step1, 1), f"batch_{BATCH}": round(step8, 1),
                           "per_token_ceiling": round(BATCH * step1 / step8, 2)},
        "note": "ratio = continuous tokens/s (the whole queue, 8 slots refilled as rows finish) over sequential "
                "tokens/s (one generate per prompt); per_batch = each group of 8 through both sides back to back "
                "(order alternating); per_token_ceiling = what batching gains per decode step on this machine, "
                "before rows that stop early leave slots with nothing to refill them",
    }
    res["ratio"] = round(res["continuous"]["tokens_per_s"] / res["sequential"]["tokens_per_s"], 2)
    res["goal"] = ">= 3.0, ids equal"
    res["met"] = res["ratio"] >= 3.0 and res["ids_equal"]
    out = repo_root() / "outputs" / "bench" / "local_generate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "per_batch"}, indent=2))
    print("per batch:", [(r["prompts"], max(r["prompt_tokens"]), r["ratio"], r["ids_equal"]) for r in res["per_batch"]])
    return res


if __name__ == "__main__":
    main()
