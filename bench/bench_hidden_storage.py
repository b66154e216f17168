"""What each hidden-state storage costs in error, measured on the target's own predictions; writes outputs/bench/hidden_storage.json.

For every stored state (aux low/mid/high, pre-norm, post-norm) and every storage of
`eagle3data.core.quant` (bf16; fp8_e4m3 and int8 under each scale scheme), against the fp32
states of the same forward:
- relative error (Frobenius), max error relative to the state's absmax, share of non-zero
  values flushed to zero or (fp8) subnormal;
- the final states: the target's head (final norm first for the pre-norm state, then lm_head)
  on the stored state against the fp32 forward's next-token distribution at output positions:
  top-1 agreement and KL(fp32 || stored) per position;
- the aux layers: the model continued from the stored state (the layer's output replaced by its
  stored value, the rest of the forward in fp32): top-1 and KL of the final distribution, so an
  aux layer's loss is measured on the target's prediction too;
- bytes per token of the five states (values + scales).
The states are quantized as 04 stores them: captured in bf16 (`hidden.dtype`), channel
statistics from the whole shard (the embedded mix fits one), errors against the fp32 states.
Records: the embedded run's (`make run`), else the small run `bench_hidden.py` generates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "bench"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hidden import ensure_records  # noqa: E402  (the bench runs' one record source)

STATE_NAMES = ("aux_low", "aux_mid", "aux_high", "pre_norm", "post_norm")


def storages():
    from eagle3data.core.quant import SCALES, Storage

    yield Storage("bf16")
    for fmt in ("fp8_e4m3", "int8"):
        for scale in SCALES:
            yield Storage(fmt, scale)


def kl_top1(ref_logp, logits) -> tuple[float, float, int]:
    """Sum of KL(ref || q) over positions, top-1 agreements, positions."""
    import torch

    logq = torch.log_softmax(logits.float(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - logq)).sum(-1)
    agree = (logq.argmax(-1) == ref_logp.argmax(-1))
    return float(kl.sum()), float(agree.sum()), int(kl.numel())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-samples", type=int, default=0, help="use at most this many samples (0 = all)")
    args = ap.parse_args()
    import torch

    from eagle3data.core.models import model_for
    from eagle3data.core.params import load_params
    from eagle3data.hidden.capture import Capture, decoder_of, layer_plan
    from eagle3data.hidden.extract import plan_extract
    from eagle3data.core.quant import channel_stats, dequantize, flushed_share, quantize

    t_start = time.perf_counter()
    run_root, records_from = ensure_records()
    p = load_params(REPO / "params" / "embedded.yaml",
                    {"output_root": str(run_root), "run_name": "embedded", "hidden.probe_batches": 0,
                     "hidden.final_state": "both", "model.dtype": "float32"})
    model = model_for(p).float().eval()
    plan = plan_extract(p, model=model)
    samples = [s for s in plan.mix.samples if sum(s.loss_mask) > 1]
    if args.max_samples:
        samples = samples[: args.max_samples]
    layers = layer_plan(p, model.config)
    dec = decoder_of(model)
    head = model.get_output_embeddings()
    with Capture(model, layers, torch.float32, "both") as cap:  # the fp32 states of every sample, [n, 5, H] each
        fp32 = [cap.run(torch.tensor([s.input_ids]))[0] for s in samples]
    # as 04 stores them: captured in bf16 (hidden.dtype), then quantized with the shard's own channel statistics
    # (the embedded mix fits one shard, so the shard is every sample)
    block = torch.cat(fp32).to(torch.bfloat16).float()
    channels = {sc: channel_stats(block, sc) for sc in ("channel_token", "channel_rms")}
    del block

    figs: dict[str, dict[str, dict[str, float]]] = {}
    acc: dict[tuple[str, str], dict[str, float]] = {}

    def add(st, name, **kv):
        a = acc.setdefault((st, name), {})
        for k, v in kv.items():
            a[k] = a.get(k, 0.0) + v if k != "max_err" and k != "absmax" else max(a.get(k, 0.0), v)

    positions = 0
    for k, s in enumerate(samples):
        print(f"  sample {k + 1}/{len(samples)} ({len(s.input_ids)} tokens)", file=sys.stderr, flush=True)
        ids = torch.tensor([s.input_ids])
        x = fp32[k]  # fp32 [n, 5, H]
        xb = x.to(torch.bfloat16).float()
        out = torch.tensor(s.loss_mask, dtype=torch.bool).nonzero().flatten()
        out = out[out < len(s.input_ids) - 1]  # positions whose next token is known
        if len(out) == 0:
            continue
        positions += len(out)
        with torch.inference_mode():
            ref_logp = torch.log_softmax(head(x[out, 4]).float(), -1)  # the fp32 model's next-token distribution
        stored = {}
        for st in storages():
            ch = channels.get(st.scale) if st.needs_channels else None
            q, sc = quantize(xb, st, ch)
            y = dequantize(q, sc, st, ch, torch.float32)
            stored[st.name] = y
            for i, name in enumerate(STATE_NAMES):
                d = (y[:, i] - x[:, i])
                add(st.name, name, err2=float((d ** 2).sum()), ref2=float((x[:, i] ** 2).sum()),
                    max_err=float(d.abs().max()), absmax=float(x[:, i].abs().max()),
                    flushed=flushed_share(xb[:, i : i + 1], st, None if ch is None else ch[i : i + 1]) * x[:, i].numel(),
                    values=float(x[:, i].numel()))
            with torch.inference_mode():
                for i, name in ((3, "pre_norm"), (4, "post_norm")):
                    h = dec.norm(y[out, 3]) if name == "pre_norm" else y[out, 4]
                    kl, agree, n = kl_top1(ref_logp, head(h))
                    add(st.name, name, kl=kl, top1=agree, positions=n)
        names = list(stored)
        end = int(out.max()) + 1  # the forward needs no position after the last one measured
        for i, name in enumerate(STATE_NAMES[:3]):  # every storage at once: one batch row each
            repl = torch.stack([stored[k][:end, i] for k in names])
            layer = dec.layers[layers.layer_outputs[i]]

            def hook(_m, _inp, o, repl=repl):
                return (repl,) + tuple(o[1:]) if isinstance(o, tuple) else repl

            hd = layer.register_forward_hook(hook)
            try:
                with torch.inference_mode():
                    h = dec(input_ids=ids[:, :end].expand(len(names), end), use_cache=False).last_hidden_state
                    for r, k in enumerate(names):
                        kl, agree, n = kl_top1(ref_logp, head(h[r, out]))
                        add(k, name, kl=kl, top1=agree, positions=n)
            finally:
                hd.remove()

    hidden = int(x.shape[-1])
    for st in storages():
        row = {}
        for name in STATE_NAMES:
            a = acc[(st.name, name)]
            row[name] = {
                "relative_error": round((a["err2"] / a["ref2"]) ** 0.5, 5),
                "max_error_over_absmax": round(a["max_err"] / a["absmax"], 5),
                "flushed_share": round(a["flushed"] / a["values"], 6),
                "top1": round(a["top1"] / a["positions"], 4),
                "kl_per_position": float(f"{a['kl'] / a['positions']:.3g}"),
            }
        row["bytes_per_token_5_states"] = st.bytes_per_token(5, hidden)
        row["bytes_per_token_4_states"] = st.bytes_per_token(4, hidden)
        row["ratio_to_bf16"] = round(st.bytes_per_token(5, hidden) / (5 * hidden * 2), 4)
        figs[st.name] = row
    result = {
        "records_from": records_from, "samples": len(samples), "output_positions": positions, "hidden_size": hidden,
        "aux_hf_indices": list(layers.hf_indices),
        "note": "aux top1/kl: the model continued in fp32 from the stored aux state; final: the head on the stored "
                "state; all against the fp32 forward's next-token distribution",
        "storages": figs, "seconds": round(time.perf_counter() - t_start, 1),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "hidden_storage.json").write_text(json.dumps(result, indent=2))
    print(f"{'storage':24s} " + " ".join(f"{n:>22s}" for n in STATE_NAMES) + "   B/token(5)")
    for name, row in figs.items():
        cells = [f"{row[n]['relative_error']:.4f} {row[n]['top1']:.4f} {row[n]['kl_per_position']:.1e}" for n in STATE_NAMES]
        print(f"{name:24s} " + " ".join(f"{c:>22s}" for c in cells) + f"   {row['bytes_per_token_5_states']}")
    print(f"(relative error, top-1, KL per position) on {positions} output positions of {len(samples)} samples; "
          f"{records_from}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
