"""05 hand-off: disk used relative to hidden/, link vs convert, and each trainer's head on the handed-off state.

Generates the run of PARAMS (default params/ci.yaml) into a temp folder, runs 04 once per
trainer layout (`hidden.layout` specforge / speculators, `final_state: both`), hands the mix
to both trainers from each store, and reports: bytes of hidden/ and of each hand-off (hardlinked
files counted once), and greedy next-token hits of the output tokens through each trainer's head
(SpecForge: lm_head(hidden_state); speculators: lm_head(norm(verifier_last_hidden_states))), read
back with the trainers' own loaders, against the norm-twice mistake. Figures ->
outputs/bench/handoff.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def hits(logits, ids, mask):
    pick = mask[1:].bool()
    return int((logits[:-1].argmax(-1)[pick] == ids[1:][pick]).sum()), int(pick.sum())


def main(params_file: str = "params/ci.yaml") -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import specforge.data.preprocessing as sfp
    from speculators.train.data import ArrowDataset

    from eagle3data.export import handoff as HO
    from eagle3data.generate.run import run_generate
    from eagle3data.hidden.extract import run_extract
    from eagle3data.hidden.mix import read_mix
    from eagle3data.core.models import model_for
    from eagle3data.core.params import load_params

    root = Path(tempfile.mkdtemp(prefix="bench_handoff_"))
    base = load_params(REPO / params_file, {"output_root": str(root / "gen")})
    run_generate(base, progress=False)
    model = None
    out: dict = {"params": params_file}
    for layout in ("specforge", "speculators"):
        p = load_params(REPO / params_file, {"output_root": str(root / layout), "hidden.layout": layout,
                                             "hidden.probe_batches": 0})
        (p.run_dir).mkdir(parents=True)
        os.symlink(base.run_dir / "records", p.run_dir / "records")
        model = model or model_for(p)
        res = run_extract(p, progress=False, model=model)
        mix = read_mix(res.hidden_dir)
        dirs = {fmt: p.run_dir / "export" / fmt for fmt in HO.FORMATS}
        man = {fmt: HO.write_handoff(p, mix.samples, d, fmt) for fmt, d in dirs.items()}
        disk = HO.disk_table(res.hidden_dir, dirs)
        heads = {}
        sf = sfp.build_offline_eagle3_dataset(str(dirs["specforge"] / "features"), max_len=1 << 20)
        sp = ArrowDataset(max_len=1 << 20, datapath=str(dirs["speculators"]), on_missing="raise")
        counts = {"specforge": [0, 0, 0], "speculators": [0, 0, 0]}
        with torch.inference_mode():
            for i, s in enumerate(mix.samples):
                m = torch.tensor(s.loss_mask)
                t = sf[i]["target"][0].float()
                a, n = hits(model.lm_head(t), sf[i]["input_ids"][0], m)
                b, _ = hits(model.lm_head(model.model.norm(t)), sf[i]["input_ids"][0], m)
                counts["specforge"] = [counts["specforge"][0] + a, counts["specforge"][1] + b, counts["specforge"][2] + n]
                v = sp[i]["verifier_last_hidden_states"].float()
                a, n = hits(model.lm_head(model.model.norm(v)), sp[i]["input_ids"], m)
                b, _ = hits(model.lm_head(model.model.norm(model.model.norm(v))), sp[i]["input_ids"], m)
                counts["speculators"] = [counts["speculators"][0] + a, counts["speculators"][1] + b,
                                         counts["speculators"][2] + n]
        for fmt, (a, b, n) in counts.items():
            heads[fmt] = {"next_token_hits": f"{a}/{n}", "normed_twice_hits": f"{b}/{n}"}
        out[layout] = {"samples": len(mix.samples), "tokens": man["specforge"]["tokens"],
                       "modes": {f: m["plan"]["mode"] for f, m in man.items()},
                       "disk": disk.to_dict(orient="records"), "heads": heads}
    dest = REPO / "outputs" / "bench" / "handoff.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main(*sys.argv[1:])
