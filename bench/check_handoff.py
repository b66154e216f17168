"""Load a run's hand-off with the trainers' own loaders (SpecForge 0.2.0, speculators 0.9.0) and report.

    python bench/check_handoff.py outputs/embedded

For each format under `<run>/export/`: the peer's loader reads every row; ids, mask and states
equal 04's store; bytes the hand-off added on disk (hardlinked files counted once) relative to
`hidden/`. The online hand-offs (`speculators_online/`, `specforge_online/`: no states) are read by
speculators' `ArrowDataset` (the ids its vLLM client would send, `build_client_item`) and SpecForge's
`load_config` + `prepare_prompt_tasks`, every row equal to the mix in order (after the trainers'
own cut at the exported max_length). Prints one JSON object; exit 1 when a hand-off differs.
Needs the peers installed as the Makefile installs them.
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
    """Bytes of the files under `folder` whose inode was not seen yet (a hardlink costs nothing; a symlink, such as
    SpecForge's `model` and `target/` links to the model's files, is no byte of the hand-off)."""
    total = 0
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
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
    out: dict = {"run": str(run_dir)}
    out.update(check_online(run_dir))
    if not (hdir / "index.parquet").exists():  # hidden.enabled false: online hand-offs only
        return out
    rd = HiddenReader(hdir)
    mix = read_mix(hdir)
    at = {x: i for i, x in enumerate(rd.states)}
    seen: set[tuple[int, int]] = set()
    hidden_bytes = _disk(hdir, seen)
    out |= {"hidden_bytes": hidden_bytes, "samples": len(mix.samples)}
    sf = run_dir / "export" / "specforge"
    if (sf / "features").is_dir():
        from specforge.data import preprocessing as pre

        ds = pre.build_offline_eagle3_dataset(str(sf / "features"), max_len=1 << 16)
        ok = len(ds) == len(mix.samples)
        for i, s in enumerate(mix.samples):
            item, ours = ds[i], rd.sample(s.key)["hidden_states"]
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
            item, ours = ds[i], rd.sample(s.key)["hidden_states"]
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


def _online_rows(run_dir: Path, handoff: dict) -> list[tuple[str, list[int], list[int]]]:
    """The mix's rows as the online hand-off promises them: its kept keys, in order, cut at its max_length."""
    from eagle3data.export.run import params_of_run, select_samples

    by_key = {str(s.key): s for s in select_samples(params_of_run(run_dir)).samples}
    L = handoff["max_length"]
    return [(k, list(by_key[k].input_ids[:L]), list(by_key[k].loss_mask[:L])) for k in handoff["keys"]]


def check_online(run_dir: Path) -> dict:
    """Each online hand-off read by its trainer's own loader: rows equal to the mix, in order."""
    res: dict = {}
    sp = run_dir / "export" / "speculators_online"
    if (sp / "handoff.json").exists():
        from speculators.train.data import ArrowDataset, build_client_item

        ho = json.loads((sp / "handoff.json").read_text())
        want = _online_rows(run_dir, ho)
        ds = ArrowDataset(max_len=max(ho["max_length"], 1), datapath=str(sp), on_missing="generate")
        bad = [k for i, (k, ids, mask) in enumerate(want)
               if build_client_item(ds.data[i])["input_ids"] != ids or ds.data[i]["loss_mask"].tolist() != mask
               or ds.approx_lengths[i] != len(ids)]
        res["speculators_online"] = {"rows": len(ds), "equal_to_mix": len(ds) == len(want) and not bad,
                                     "differing": bad[:5], "hidden_states_dir": (sp / "hidden_states").exists(),
                                     "window": {k: len(v) for k, v in ho["window"].items() if isinstance(v, list)}}
    sf = run_dir / "export" / "specforge_online"
    if (sf / "handoff.json").exists():
        from specforge.config import load_config
        from specforge.data.prompt_builder import prepare_prompt_tasks

        ho = json.loads((sf / "handoff.json").read_text())
        want = _online_rows(run_dir, ho)
        cwd = os.getcwd()
        os.chdir(sf)  # SpecForge resolves the config's relative paths from the working directory
        try:
            cfg = load_config("specforge.yaml", [])
            tasks = prepare_prompt_tasks(cfg.data.prompts_path, None, chat_template=cfg.data.chat_template,
                                         max_length=cfg.data.max_length, is_preformatted=False,
                                         train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=1,
                                         min_loss_tokens=1)
        finally:
            os.chdir(cwd)
        got = [(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks]
        bad = [k for (k, ids, mask), g in zip(want, got) if g != (ids, mask)]
        res["specforge_online"] = {"rows": len(got), "mode": cfg.mode,
                                   "equal_to_mix": len(got) == len(want) and not bad, "differing": bad[:5]}
    return res


if __name__ == "__main__":
    report = main(sys.argv[1] if len(sys.argv) > 1 else "outputs/embedded")
    print(json.dumps(report, indent=2))
    sys.exit(0 if all(v.get("equal_to_mix", v.get("equal_to_store", True)) for v in report.values()
                      if isinstance(v, dict)) else 1)
