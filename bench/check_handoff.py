"""Load a run's hand-off with the trainers' own loaders (SpecForge 0.2.0, speculators 0.9.0) and report.

    python bench/check_handoff.py outputs/embedded

For each format under `<run>/export/`: the peer's loader reads every row; ids, mask and states
equal 04's store; bytes the hand-off added on disk (hardlinked files counted once) relative to
`hidden/`. Prints one JSON object. Needs the peers installed as the Makefile installs them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lib"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _disk(folder: Path, seen: set[tuple[int, int]]) -> int:
    """Bytes of the files under `folder` whose inode was not seen yet (a hardlink costs nothing)."""
    total = 0
    for p in folder.rglob("*"):
        if p.is_file():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def main(run: str) -> dict:
    import torch

    from eagle3data.hidden.store.reader import HiddenReader
    from eagle3data.hidden.mix import read_mix

    run_dir = Path(run)
    hdir = run_dir / "hidden"
    rd = HiddenReader(hdir)
    mix = read_mix(hdir)
    at = {x: i for i, x in enumerate(rd.states)}
    seen: set[tuple[int, int]] = set()
    hidden_bytes = _disk(hdir, seen)
    out: dict = {"run": str(run_dir), "hidden_bytes": hidden_bytes, "samples": len(mix.samples)}
    sf = run_dir / "export" / "specforge"
    if (sf / "features").is_dir():
        from specforge.data import preprocessing as pre

        ds = pre.build_offline_eagle3_dataset(str(sf / "features"), max_len=1 << 16)
        ok = len(ds) == len(mix.samples)
        for i, s in enumerate(mix.samples):
            item, ours = ds[i], rd.sample(f"{s.dataset}/{s.sample_id}")["hidden_states"]
            n = len(s.input_ids)
            ok &= item["input_ids"][0].tolist() == s.input_ids
            ok &= item["loss_mask"][0].tolist() == s.loss_mask[:-1] + [0]  # its loader zeroes the last position
            ok &= torch.equal(item["target"][0], ours[:, at["post_norm"]]) if "post_norm" in at else False
            ok &= torch.equal(item["hidden_state"][0], ours[:, :3].reshape(n, -1))
        out["specforge"] = {"rows": len(ds), "equal_to_store": bool(ok), "added_bytes": _disk(sf, seen)}
    sp = run_dir / "export" / "speculators"
    if (sp / "hidden_states").is_dir():
        from speculators.train.data import ArrowDataset

        ds = ArrowDataset(max_len=1 << 16, datapath=str(sp), on_missing="raise")
        ok = len(ds) == len(mix.samples)
        for i, s in enumerate(mix.samples):
            item, ours = ds[i], rd.sample(f"{s.dataset}/{s.sample_id}")["hidden_states"]
            n = len(s.input_ids)
            ok &= item["input_ids"].tolist() == s.input_ids and item["loss_mask"].tolist() == s.loss_mask
            ok &= torch.equal(item["verifier_last_hidden_states"], ours[:, at["pre_norm"]]) if "pre_norm" in at else False
            ok &= torch.equal(item["hidden_states"], ours[:, :3].reshape(n, -1))
        out["speculators"] = {"rows": len(ds), "equal_to_store": bool(ok), "added_bytes": _disk(sp, seen)}
    for fmt in ("specforge", "speculators"):
        if fmt in out:
            out[fmt]["added_vs_hidden"] = round(out[fmt]["added_bytes"] / hidden_bytes, 3)
            m = json.loads((run_dir / "export" / fmt / "handoff.json").read_text())
            out[fmt]["mode"] = m["plan"]["mode"]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "outputs/embedded"), indent=2))
