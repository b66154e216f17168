"""05 hand-off: the training mix in each trainer's own on-disk layout, read by the trainer's own loader.

What each trainer reads (checked against the released code: SpecForge 0.2.0, speculators
0.9.0) is its module's in `eagle3data.trainers`: its per-sample files and their names, its
final state (SpecForge post-norm, speculators pre-norm), its vocabulary files and the rest of
its folder (SpecForge's `specforge.yaml` with its target head, speculators' `datasets`
folder). This module decides link or convert, checks every row and writes the manifest.

No second copy of the hidden states: when 04 ran with `hidden.layout` equal to the trainer
(`specforge` / `speculators`) its per-sample files already are the trainer's files, and the
hand-off **hardlinks** them under the trainer's names (0 extra bytes; the export dir must be on
the filesystem of `hidden/`). From any other store (the default `shards`, or the other
trainer's layout) the hand-off converts, which is a full second copy: `plan_handoff` says how
many bytes each way needs, and `write_handoff` refuses a conversion the free disk cannot hold.

The rows are exactly the samples handed in (the mix, in its order): each one must be in 04's
index with the same input ids and loss mask, or the hand-off stops naming it. Before anything is
linked or converted every file of the store it uses is checked against the content checksum 04
recorded (`store.checksum`): a file changed since (a bad copy, bit rot) or cut short stops it, in
one line naming the file and its samples.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import orjson

from eagle3data.hidden.store.format import INDEX_FILE, split_states
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.trainers.base import HandoffError
from eagle3data.trainers.registry import TRAINERS, get_trainer
from eagle3data.core.atomic import write_atomic
from eagle3data.core.models import _quiet_transformers, resolve_model_path
from eagle3data.core.profiles import get_profile
from eagle3data.export.rows import keys_of
from eagle3data.export.vocab import build_draft_vocab, output_token_counts
from eagle3data.hidden.estimate import codec_name
from eagle3data.hidden.mix import hidden_dir as default_hidden_dir

FORMATS = tuple(TRAINERS)  # the trainers a hand-off is written for
MANIFEST = "handoff.json"


@dataclass
class HandoffPlan:
    """How the hand-off to one trainer will be made and what it needs on disk, before anything is written."""

    fmt: str
    mode: str  # "link" (hardlink 04's files) or "convert" (write the trainer's files: a second copy)
    samples: int
    tokens: int
    store_bytes: int  # bytes of 04's files for these samples
    new_bytes: int  # hidden-state bytes the hand-off writes (0 when linking)
    free_bytes: int
    margin: float
    reason: str

    @property
    def fits(self) -> bool:
        return self.free_bytes >= self.new_bytes * self.margin

    def as_dict(self) -> dict[str, Any]:
        return {"format": self.fmt, "mode": self.mode, "samples": self.samples, "tokens": self.tokens,
                "store_bytes": self.store_bytes, "new_bytes": self.new_bytes, "free_bytes": self.free_bytes,
                "fits": self.fits, "reason": self.reason}


def _same_fs(a: Path, b: Path) -> bool:
    def dev(p: Path) -> int:
        while not p.exists():
            p = p.parent
        return p.stat().st_dev

    return dev(a) == dev(b)


def _free(path: Path) -> int:
    p = Path(path)
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def plan_handoff(reader: HiddenReader, fmt: str, samples: Sequence[Any], out_dir: str | Path,
                 margin: float = 1.05) -> HandoffPlan:
    """Link or convert, and the bytes that takes, for these samples handed to `fmt` in `out_dir`."""
    if fmt not in FORMATS:
        raise HandoffError(f"unknown hand-off format {fmt!r}; formats: {', '.join(FORMATS)}")
    trainer, info = get_trainer(fmt), reader.info
    final = info.get("final_state") or "post_norm"
    need = trainer.final_state
    if need not in reader.states:
        raise HandoffError(f"{reader.dir}: 04 stored {list(reader.states)}; {fmt} needs the {need} final state. "
                           f"Rerun 04 with hidden.final_state {need!r} or 'both'")
    rows = [reader.row(k) for k in keys_of(samples)]
    idx = [r for r in rows if r is not None]
    tokens = int(reader.index["length"].iloc[idx].sum()) if idx else 0
    per = int(info.get("bytes_per_token") or 0)
    store_bytes = tokens * per
    out_dir = Path(out_dir)
    bpt = trainer.handoff_bytes_per_token(reader.layout, final, int(info["hidden_size"]), info["dtype"])
    if bpt == 0 and _same_fs(reader.dir, out_dir):
        return HandoffPlan(fmt, "link", len(samples), tokens, store_bytes, 0, _free(out_dir), margin,
                           f"04 wrote {fmt}'s own files (hidden.layout {fmt!r}): hardlinked, no copy")
    if bpt == 0:
        bpt = trainer.file_bytes_per_token(int(info["hidden_size"]), info["dtype"])
        why = f"{out_dir} is on another filesystem than {reader.dir}: hardlinks impossible, a full copy"
    else:
        why = (f"04 wrote layout {reader.layout!r}: converted to {fmt}'s files, a full second copy "
               f"(run 04 with hidden.layout {fmt!r} to hardlink instead)")
    if reader.codec.quantized:
        why += (f"; the store is 8-bit ({codec_name(reader.codec)}): dequantized to {info['dtype']} as written, "
                f"since {fmt} reads only that from this store")
    return HandoffPlan(fmt, "convert", len(samples), tokens, store_bytes, tokens * bpt, _free(out_dir), margin, why)


def _link(src: Path, dst: Path) -> None:
    if dst.exists() or dst.is_symlink():
        if dst.exists() and os.path.samefile(src, dst):
            return
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise HandoffError(f"cannot hardlink {src} -> {dst}: another filesystem; put the export on the disk "
                               "of hidden/ (or let the hand-off convert)") from None
        raise


def draft_vocab_for(samples: Iterable[Any], target_vocab_size: int, draft_vocab_size: int) -> Any:
    """The EAGLE-3 draft vocabulary of these samples' output tokens (`vocab.py`; the export passes its own instead)."""
    return build_draft_vocab(output_token_counts(samples, target_vocab_size), draft_vocab_size)


def write_handoff(params: Any, samples: Sequence[Any], out_dir: str | Path, fmt: str, *, vocab: Any = None,
                  hidden_dir: str | Path | None = None, progress: bool = False) -> dict[str, Any]:
    """Write `fmt`'s layout of `samples` (the mix, in order) into `out_dir`; return the manifest.

    `samples`: objects with `dataset`, `sample_id`, `input_ids`, `loss_mask` (e.g.
    `hidden.read_mix(...).samples`), or 05's `Selection` (read a chunk at a time). `vocab`: a `DraftVocab`
    (d2t, t2d); built from the samples' output tokens with `export.draft_vocab_size` when None. Files this hand-off wrote
    before and no longer needs (a smaller mix) are removed.
    """
    t0 = time.perf_counter()
    hdir = Path(hidden_dir) if hidden_dir else default_hidden_dir(params)
    reader = HiddenReader(hdir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_handoff(reader, fmt, samples, out)
    if plan.mode == "convert" and not plan.fits:
        raise HandoffError(f"not enough disk at {out}: converting to {fmt} writes {plan.new_bytes / 1e9:.2f} GB "
                           f"(x{plan.margin} margin) but {plan.free_bytes / 1e9:.2f} GB are free. {plan.reason}")
    rows: list[int] = []
    keys = keys_of(samples)
    for k in keys:
        r = reader.row(k)
        if r is None:
            raise HandoffError(f"{str(k)}: not in 04's index at {hdir / INDEX_FILE} "
                               "(run 04 on this mix first)")
        rows.append(r)
    for f in dict.fromkeys(reader.index["shard"].iloc[rows].tolist()):  # before anything is linked or converted
        if why := reader.file_problem(f):  # its content checksum (a store written before checksums: it exists)
            raise HandoffError(f"{why}: restore the file, or delete it and rerun 04 for its samples")
    if vocab is None:
        vocab = draft_vocab_for(samples, get_profile(params.profile).vocab_size, params.export.draft_vocab_size)

    from tqdm.auto import tqdm

    names, trainer = reader.states, get_trainer(fmt)
    data = out / trainer.handoff_dir
    data.mkdir(parents=True, exist_ok=True)
    wanted: set[str] = set()
    linked = converted = written = 0
    for i, (s, r) in enumerate(tqdm(zip(samples, rows), total=len(rows), desc=f"hand-off {fmt}",
                                    disable=not progress)):  # the samples as they are read, a chunk at a time
        dst = data / trainer.handoff_name(i)
        wanted.add(dst.name)
        if plan.mode == "link":
            ids, mask = reader.stored_ids(r)
            if ids != list(s.input_ids) or mask != list(s.loss_mask):
                raise HandoffError(f"{reader.path(r)}: stored input_ids/loss_mask differ from the mix sample "
                                   f"{str(s.key)}: rerun 04 on this mix")
            _link(reader.path(r), dst)
            linked += 1
        else:
            smp = reader.sample(r)
            if smp["input_ids"].tolist() != list(s.input_ids) or smp["loss_mask"].tolist() != list(s.loss_mask):
                raise HandoffError(f"{reader.path(r)}: stored input_ids/loss_mask differ from the mix sample "
                                   f"{str(s.key)}: rerun 04 on this mix")
            aux, finals = split_states(smp["hidden_states"], names)
            written += trainer.write_sample(dst, s.input_ids, s.loss_mask, aux,
                                            {trainer.final_state: finals[trainer.final_state]})
            converted += 1
    for p in data.iterdir():  # stale files of an earlier, larger hand-off
        if p.name not in wanted:
            p.unlink()

    d2t = np.ascontiguousarray(vocab.d2t, dtype=np.int64)
    t2d = np.ascontiguousarray(vocab.t2d, dtype=bool)
    files, extra = trainer.write_handoff_files(out, samples, d2t, t2d, params, lambda: _model_dir(params))
    stat = {"linked_files": linked, "converted_files": converted, "converted_bytes": written,
            "storage": codec_name(reader.codec) if plan.mode == "link" else reader.info["dtype"]}
    if plan.mode == "link" and reader.codec.quantized:  # hs-connectors' FP8 files (the params allow no other)
        stat["hidden_states_backend"] = "fp8"  # speculators: train with --hidden-states-backend fp8 (FP8Transfer)
    manifest = {
        "format": fmt, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "hidden_dir": str(hdir),
        "plan": plan.as_dict(), **stat, "rows": len(rows), "tokens": plan.tokens,
        "keys": [str(k) for k in keys],
        "final_state": trainer.final_state, "store_states": list(names), "store_layout": reader.layout,
        "draft_vocab_size": int(len(d2t)), "files": files, "seconds": round(time.perf_counter() - t0, 3),
        **extra,
    }
    write_atomic(out / MANIFEST, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    return manifest


def _model_dir(params: Any) -> Path | None:
    """The target's folder on this machine, or None (asked by a trainer whose files name it; transformers quieted
    for the config reading that follows)."""
    _quiet_transformers()
    try:
        return resolve_model_path(params.model.path)
    except Exception:  # noqa: BLE001 - a model folder only the GPU machine has
        return None


def disk_table(hidden: str | Path, out_dirs: dict[str, str | Path]):
    """Bytes on disk of hidden/ and of each hand-off folder, counting hardlinked files once (du-like).

    Symlinks count nothing: SpecForge's `target/` links to the model's files, which are not the hand-off's."""
    import pandas as pd

    seen: set[tuple[int, int]] = set()

    def usage(root: Path) -> tuple[int, int]:
        new = total = 0
        for p in sorted(Path(root).rglob("*")):
            if p.is_symlink() or not p.is_file():
                continue
            st = p.stat()
            total += st.st_size
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                new += st.st_size
        return total, new

    rows = []
    h_total, h_new = usage(Path(hidden))
    rows.append({"folder": str(hidden), "apparent_bytes": h_total, "new_bytes": h_new})
    for name, d in out_dirs.items():
        t, n = usage(Path(d))
        rows.append({"folder": f"{name}: {d}", "apparent_bytes": t, "new_bytes": n})
    df = pd.DataFrame(rows)
    df["new_vs_hidden"] = (df["new_bytes"] / max(h_new, 1)).round(4)
    return df


__all__ = ["FORMATS", "HandoffError", "HandoffPlan", "disk_table", "draft_vocab_for", "plan_handoff", "write_handoff"]
