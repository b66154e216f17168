"""05 hand-off: the training mix in each trainer's own on-disk layout, read by the trainer's own loader.

Layouts (checked against the released code: SpecForge 0.2.0, speculators 0.9.0):

- **SpecForge** (`data.hidden_states_path` of `specforge train -c CONFIG`; read by
  `specforge.data.preprocessing.build_offline_eagle3_dataset` and
  `runtime.data_plane.offline_reader.OfflineManifestReader`): one torch file per sample,
  `features/<row, 9 digits>.ckpt` (the loader sorts paths as text), holding `input_ids` and
  `loss_mask` (int64 [n]), `hidden_state` [1, n, H] (the **post-norm** final state: its
  target head is a bare `lm_head`) and `aux_hidden_state` [1, n, 3H]; `vocab_mapping.pt`
  `{d2t int64, t2d bool}` for `model.vocab_mapping_path`; `specforge.yaml`, a config for
  `specforge train` whose target head SpecForge loads itself (`specforge_target`: the model
  folder, or `target/` beside it when the folder has no weight index; the head's key, the
  embedding's when the model ties them), and `draft_config.json` when the draft vocabulary is
  not SpecForge's generated 32000.
- **speculators** (`--data-path` of `speculators train`; read by
  `speculators.train.data.ArrowDataset(datapath=…)`): a `datasets` `save_to_disk` folder with
  `input_ids`, `loss_mask`, `seq_len` in torch format, `hidden_states/hs_<row>.safetensors`
  holding `hidden_states` [n, 4, H] (3 aux + the **pre-norm** last-layer output: speculators
  applies the verifier's norm itself) and `token_ids` int64 [n] (row i <-> file i), and
  `d2t-<N>.npy` / `t2d-<N>.npy`, which its training CLI discovers for `--draft-vocab-size N`.

No second copy of the hidden states: when 04 ran with `hidden.layout` equal to the trainer
(`specforge` / `speculators`) its per-sample files already are the trainer's files, and the
hand-off **hardlinks** them under the trainer's names (0 extra bytes; the export dir must be on
the filesystem of `hidden/`). From any other store (the default `shards`, or the other
trainer's layout) the hand-off converts, which is a full second copy: `plan_handoff` says how
many bytes each way needs, and `write_handoff` refuses a conversion the free disk cannot hold.

The rows are exactly the samples handed in (the mix, in its order): each one must be in 04's
index with the same input ids and loss mask, or the hand-off stops naming it.
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

from eagle3data.core.errors import UserInputError
from eagle3data.hidden.extract import HiddenReader, handoff_bytes_per_token, write_sample_file
from eagle3data.core.reader import SampleKey

FORMATS = ("specforge", "speculators")
NEEDS = {"specforge": "post_norm", "speculators": "pre_norm"}
FEATURES = "features"  # SpecForge's per-sample files, under the hand-off folder
HS_DIR = "hidden_states"  # speculators' per-sample files, under the dataset folder
MANIFEST = "handoff.json"
SPECFORGE_TARGET = "target"  # the model folder as SpecForge reads it, when the folder itself has no weight index
SPECFORGE_DRAFT_CONFIG = "draft_config.json"
SPECFORGE_DRAFT_VOCAB = 32000  # draft_vocab_size of the EAGLE-3 draft config SpecForge 0.2.0 generates
HEAD_KEY, EMBED_KEY = "lm_head.weight", "model.embed_tokens.weight"  # SpecForge's defaults for both keys


class HandoffError(UserInputError, RuntimeError):
    """The hand-off cannot be written as asked; the message says why and what to do."""


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
    info = reader.info
    final = info.get("final_state") or "post_norm"
    if NEEDS[fmt] not in reader.states:
        raise HandoffError(f"{reader.dir}: 04 stored {list(reader.states)}; {fmt} needs the {NEEDS[fmt]} final state. "
                           f"Rerun 04 with hidden.final_state {NEEDS[fmt]!r} or 'both'")
    rows = [reader._rows.get(str(s.key)) for s in samples]
    idx = [r for r in rows if r is not None]
    tokens = int(reader.index["length"].iloc[idx].sum()) if idx else 0
    per = int(info.get("bytes_per_token") or 0)
    store_bytes = tokens * per
    out_dir = Path(out_dir)
    bpt = handoff_bytes_per_token(fmt, reader.layout, final, int(info["hidden_size"]), info["dtype"])
    if bpt == 0 and _same_fs(reader.dir, out_dir):
        return HandoffPlan(fmt, "link", len(samples), tokens, store_bytes, 0, _free(out_dir), margin,
                           f"04 wrote {fmt}'s own files (hidden.layout {fmt!r}): hardlinked, no copy")
    if bpt == 0:
        bpt = handoff_bytes_per_token(fmt, "shards", final, int(info["hidden_size"]), info["dtype"]) or 0
        why = f"{out_dir} is on another filesystem than {reader.dir}: hardlinks impossible, a full copy"
    else:
        why = (f"04 wrote layout {reader.layout!r}: converted to {fmt}'s files, a full second copy "
               f"(run 04 with hidden.layout {fmt!r} to hardlink instead)")
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


def _stored_ids(reader: HiddenReader, row: int) -> tuple[list[int], list[int]]:
    """Input ids and loss mask as 04 stored them, reading only those tensors."""
    path = reader.path(row)
    if reader.layout == "speculators":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor("token_ids").tolist(), f.get_tensor("loss_mask").tolist()
    if reader.layout == "specforge":
        import torch

        raw = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        return raw["input_ids"].tolist(), raw["loss_mask"].tolist()
    smp = reader.sample(row)
    return smp["input_ids"].tolist(), smp["loss_mask"].tolist()


def draft_vocab_for(samples: Iterable[Any], target_vocab_size: int, draft_vocab_size: int) -> Any:
    """The EAGLE-3 draft vocabulary of these samples' output tokens (`vocab.py`; the export passes its own instead)."""
    from eagle3data.export.vocab import build_draft_vocab, output_token_counts

    return build_draft_vocab(output_token_counts(samples, target_vocab_size), draft_vocab_size)


def write_handoff(params: Any, samples: Sequence[Any], out_dir: str | Path, fmt: str, *, vocab: Any = None,
                  hidden_dir: str | Path | None = None, progress: bool = False) -> dict[str, Any]:
    """Write `fmt`'s layout of `samples` (the mix, in order) into `out_dir`; return the manifest.

    `samples`: objects with `dataset`, `sample_id`, `input_ids`, `loss_mask` (e.g.
    `hidden.read_mix(...).samples`). `vocab`: a `DraftVocab` (d2t, t2d); built from the
    samples' output tokens with `export.draft_vocab_size` when None. Files this hand-off wrote
    before and no longer needs (a smaller mix) are removed.
    """
    from eagle3data.hidden.mix import hidden_dir as default_hidden_dir

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
    for s in samples:
        r = reader._rows.get(str(s.key))
        if r is None:
            raise HandoffError(f"{str(s.key)}: not in 04's index at {hdir / 'index.parquet'} "
                               "(run 04 on this mix first)")
        rows.append(r)
    if vocab is None:
        from eagle3data.core.profiles import get_profile

        vocab = draft_vocab_for(samples, get_profile(params.profile).vocab_size, params.export.draft_vocab_size)

    from tqdm.auto import tqdm

    names = reader.states
    data = out / (FEATURES if fmt == "specforge" else HS_DIR)
    data.mkdir(parents=True, exist_ok=True)
    wanted: set[str] = set()
    linked = converted = written = 0
    for i, (s, r) in enumerate(tqdm(list(zip(samples, rows)), desc=f"hand-off {fmt}", disable=not progress)):
        dst = data / (f"{i:09d}.ckpt" if fmt == "specforge" else f"hs_{i}.safetensors")
        wanted.add(dst.name)
        if plan.mode == "link":
            ids, mask = _stored_ids(reader, r)
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
            written += write_sample_file(dst, fmt, s.input_ids, s.loss_mask, smp["hidden_states"], names,
                                         keep_extra=False)
            converted += 1
    for p in data.iterdir():  # stale files of an earlier, larger hand-off
        if p.name not in wanted:
            p.unlink()

    files: dict[str, str] = {}
    d2t = np.ascontiguousarray(vocab.d2t, dtype=np.int64)
    t2d = np.ascontiguousarray(vocab.t2d, dtype=bool)
    if fmt == "specforge":
        import torch

        torch.save({"d2t": torch.from_numpy(d2t.copy()), "t2d": torch.from_numpy(t2d.copy())}, out / "vocab_mapping.pt")
        files["vocab_mapping.pt"] = "{d2t int64 (target = draft + d2t), t2d bool}: model.vocab_mapping_path"
        files[FEATURES + "/"] = ("one torch file per row: input_ids, loss_mask int64 [n], hidden_state [1,n,H] "
                                 "post-norm, aux_hidden_state [1,n,3H]: data.hidden_states_path")
        target = _write_specforge_config(params, out, max(len(s.input_ids) for s in samples) if samples else 1,
                                         int(len(d2t)))
        files["specforge.yaml"] = "a config for `specforge train -c specforge.yaml` (edit training settings)"
        if target.get("view"):
            files[SPECFORGE_TARGET + "/"] = (f"links to the target's files plus {target['index']} (SpecForge's "
                                             "TargetHead reads weights only through an index): model.target_model_path")
        if target.get("draft_config"):
            files[SPECFORGE_DRAFT_CONFIG] = (f"EAGLE-3 draft config, draft_vocab_size {len(d2t)} (SpecForge generates "
                                             f"{SPECFORGE_DRAFT_VOCAB}): model.draft_model_config")
    else:
        _write_speculators_dataset(samples, out)
        n = len(d2t)
        np.save(out / f"d2t-{n}.npy", d2t)
        np.save(out / f"t2d-{n}.npy", t2d)
        files["data-*.arrow, dataset_info.json, state.json"] = "datasets save_to_disk: input_ids, loss_mask, seq_len (torch)"
        files[HS_DIR + "/"] = "hs_<row>.safetensors: hidden_states [n,4,H] (3 aux + pre-norm), token_ids int64 [n]"
        files[f"d2t-{n}.npy, t2d-{n}.npy"] = "draft vocabulary, found by --draft-vocab-size " + str(n)
    stat = {"linked_files": linked, "converted_files": converted, "converted_bytes": written}
    manifest = {
        "format": fmt, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "hidden_dir": str(hdir),
        "plan": plan.as_dict(), **stat, "rows": len(rows), "tokens": plan.tokens,
        "keys": [str(s.key) for s in samples],
        "final_state": NEEDS[fmt], "store_states": list(names), "store_layout": reader.layout,
        "draft_vocab_size": int(len(d2t)), "files": files, "seconds": round(time.perf_counter() - t0, 3),
    }
    if fmt == "specforge":
        manifest["specforge_target"] = target
    (out / MANIFEST).write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    return manifest


def _write_speculators_dataset(samples: Sequence[Any], out: Path) -> None:
    """The `datasets` folder speculators' ArrowDataset loads: input_ids, loss_mask, seq_len in torch format."""
    from datasets import Dataset, Features, Sequence as Seq, Value

    feats = Features({"input_ids": Seq(Value("int64")), "loss_mask": Seq(Value("int64")), "seq_len": Value("int64")})
    ds = Dataset.from_dict({"input_ids": [list(map(int, s.input_ids)) for s in samples],
                            "loss_mask": [list(map(int, s.loss_mask)) for s in samples],
                            "seq_len": [len(s.input_ids) for s in samples]}, features=feats)
    for old in out.glob("data-*.arrow"):
        old.unlink()
    ds.with_format("torch").save_to_disk(str(out))


def _write_specforge_config(params: Any, out: Path, longest: int, draft_vocab_size: int) -> dict[str, Any]:
    """`specforge.yaml`: offline EAGLE-3 training on these features with this vocabulary (SpecForge 0.2.0 schema).

    Returns what the config says about the target (`specforge_target` in the manifest).
    """
    import yaml

    from eagle3data.core.models import resolve_model_path

    try:
        model_dir: Path | None = resolve_model_path(params.model.path)
    except Exception:  # noqa: BLE001 - a model folder only the GPU machine has
        model_dir = None
    trust = bool(params.model.trust_remote_code)
    if model_dir is None:
        target: dict[str, Any] = {
            "model_dir": params.model.path, "target_model_path": params.model.path, "view": False,
            "lm_head_key": HEAD_KEY, "embedding_key": EMBED_KEY, "tied": None,
            "note": "the model folder is not on this machine: SpecForge's defaults kept, unchecked (the folder needs "
                    "a *.index.json naming lm_head_key; a tied model needs lm_head_key model.embed_tokens.weight)"}
        _clear(out / SPECFORGE_TARGET)
    else:
        target = specforge_target(model_dir, out / SPECFORGE_TARGET)
    draft = out / SPECFORGE_DRAFT_CONFIG
    target["draft_config"] = None
    draft.unlink(missing_ok=True)
    if draft_vocab_size != SPECFORGE_DRAFT_VOCAB and model_dir is not None:
        payload = specforge_draft_config(model_dir, draft_vocab_size, trust_remote_code=trust)
        draft.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
        target["draft_config"] = str(draft.resolve())
    elif draft_vocab_size != SPECFORGE_DRAFT_VOCAB:
        target["note"] += (f"; no draft config written: SpecForge generates draft_vocab_size {SPECFORGE_DRAFT_VOCAB}, "
                           f"this vocabulary has {draft_vocab_size} (set model.draft_model_config)")
    model: dict[str, Any] = {"target_model_path": target["target_model_path"]}
    if target["draft_config"]:
        model["draft_model_config"] = target["draft_config"]
    model.update({"embedding_key": target["embedding_key"], "lm_head_key": target["lm_head_key"],
                  "vocab_mapping_path": str((out / "vocab_mapping.pt").resolve()), "trust_remote_code": trust})
    cfg = {
        "model": model,
        "data": {"hidden_states_path": str((out / FEATURES).resolve()), "max_length": int(longest)},
        "training": {"strategy": "eagle3"},
        "output_dir": str((out / "train_output").resolve()),
    }
    (out / "specforge.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return target


def _clear(path: Path) -> None:
    """Remove a folder this hand-off made (links and an index: never what the links point at)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _weight_names(path: Path) -> list[str]:
    """Tensor names of one checkpoint file, read from its header (safetensors) or memory-mapped (torch)."""
    if path.name.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    import torch

    return list(torch.load(str(path), map_location="cpu", mmap=True, weights_only=True))


def _pick(names: Iterable[str], default: str, suffix: str) -> str | None:
    """`default` if the checkpoint names it, else its one tensor ending in `suffix` (a prefixed multimodal name)."""
    names = list(names)
    if default in names:
        return default
    hits = [n for n in names if n.endswith("." + suffix)]
    return hits[0] if len(hits) == 1 else None


def specforge_target(model_dir: str | Path, view_dir: str | Path) -> dict[str, Any]:
    """The folder `model.target_model_path` names and the head/embedding keys, as SpecForge 0.2.0 loads them.

    SpecForge's offline EAGLE-3 builds `TargetHead.from_pretrained(target_model_path,
    lm_head_key=...)`, which reads the head only through the folder's one `*.index.json`
    weight map (`specforge/modeling/target/target_head.py`): a single-file checkpoint (one
    `model.safetensors`, as `prepare-model` and most small models ship) has none. The same
    path also gives SpecForge the target config (`AutoConfig`: hidden and vocabulary sizes, the
    generated draft config), the tokenizer when it needs one, the draft's frozen embedding
    (`load_embedding(path, embedding_key)`) and its resume provenance, so it must stay the
    whole model folder. With exactly one index, that folder is used as it is. Otherwise
    (none, or several, which SpecForge refuses) `view_dir` becomes that folder without being a
    copy: a symlink to every entry of the model folder except its indexes, plus one index whose
    weight map names every tensor of the checkpoint. The model folder itself is never written
    (a hub cache or a shared read-only folder). A model that ties its head to the embeddings
    stores no `lm_head.weight`: `lm_head_key` is then the embedding's key, the matrix the
    model multiplies by.
    """
    model_dir, view_dir = Path(model_dir), Path(view_dir)
    indexes = sorted(model_dir.glob("*.index.json"))
    config_file = model_dir / "config.json"
    config = orjson.loads(config_file.read_bytes()) if config_file.exists() else {}
    text = config.get("text_config") or config
    tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    view = len(indexes) != 1
    if not view:
        index_name = indexes[0].name
        weight_map = orjson.loads(indexes[0].read_bytes())["weight_map"]
        _clear(view_dir)
    else:
        named = {p.name: p for p in indexes}
        kinds = [(".safetensors", "model.safetensors.index.json"), (".bin", "pytorch_model.bin.index.json")]
        ext, index_name = next(((e, n) for e, n in kinds if any(model_dir.glob("*" + e)) or n in named), kinds[0])
        if index_name in named:  # several indexes: keep the one of the weights SpecForge reads first
            weight_map = orjson.loads(named[index_name].read_bytes())["weight_map"]
        else:
            files = sorted(p for p in model_dir.glob("*" + ext) if p.is_file())
            if not files:
                raise HandoffError(f"{model_dir}: no *.safetensors or *.bin weights: SpecForge cannot load the "
                                   "target head (point model.path at the model folder)")
            weight_map = {name: f.name for f in files for name in _weight_names(f)}
        tmp = view_dir.with_name(view_dir.name + ".tmp")
        _clear(tmp)
        tmp.mkdir(parents=True)
        for entry in sorted(model_dir.iterdir()):
            if not entry.name.endswith(".index.json"):
                os.symlink(os.path.abspath(entry), tmp / entry.name)
        (tmp / index_name).write_bytes(orjson.dumps({"metadata": {"written_by": "eagle3data handoff"},
                                                     "weight_map": weight_map}, option=orjson.OPT_INDENT_2))
        _clear(view_dir)
        tmp.rename(view_dir)
    embed = _pick(weight_map, EMBED_KEY, "embed_tokens.weight") or EMBED_KEY
    head = _pick(weight_map, HEAD_KEY, HEAD_KEY)
    tied = head is None
    if tied:
        if tie is False:
            raise HandoffError(f"{model_dir}: the checkpoint has no {HEAD_KEY} and config.json says "
                               "tie_word_embeddings false: SpecForge cannot load the target head")
        if embed not in weight_map:
            raise HandoffError(f"{model_dir}: neither {HEAD_KEY} nor an embedding (*embed_tokens.weight) in the "
                               "checkpoint: SpecForge cannot load the target head")
        head = embed
    return {"model_dir": str(model_dir), "target_model_path": str((view_dir if view else model_dir).resolve()),
            "view": view, "index": index_name, "lm_head_key": head, "embedding_key": embed, "tied": tied,
            "tie_word_embeddings": tie}


# what SpecForge 0.2.0 copies from the target config into the EAGLE-3 draft config it generates
# (specforge/training/model_loading.py: _TARGET_ARCHITECTURE_FIELDS, _generate_draft_config)
_DRAFT_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
                 "attention_dropout", "head_dim", "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id",
                 "pad_token_id", "sliding_window", "use_sliding_window", "max_window_layers")


def specforge_draft_config(model_dir: str | Path, draft_vocab_size: int, *, trust_remote_code: bool = False
                           ) -> dict[str, Any]:
    """The EAGLE-3 draft config SpecForge 0.2.0 generates from the target, with this draft vocabulary size.

    SpecForge generates the draft config with `draft_vocab_size` 32000 and no setting to change
    it: a vocabulary mapping of another size then fails to load into the draft
    (`load_vocab_mapping`: size mismatch). The export writes SpecForge's own generated config
    with our size instead, for `model.draft_model_config`.
    """
    from eagle3data.core.models import _quiet_transformers

    _quiet_transformers()
    try:
        from transformers import AutoConfig

        config: Any = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        text = getattr(config, "text_config", config)
        get = lambda f: getattr(text, f, None)  # noqa: E731
    except (OSError, ValueError, KeyError):  # as SpecForge: the raw config.json
        raw = orjson.loads((Path(model_dir) / "config.json").read_bytes())
        raw = raw.get("text_config") or raw
        get = raw.get
    import torch

    payload: dict[str, Any] = {}
    for f in _DRAFT_FIELDS:
        v = get(f)
        if v is not None:
            payload[f] = str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v
    payload["vocab_size"] = int(get("padded_vocab_size") or get("vocab_size"))
    payload.update({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                    "tie_word_embeddings": False, "use_cache": True})
    if payload.get("pad_token_id") is None:
        payload["pad_token_id"] = 0
    payload["draft_vocab_size"] = int(draft_vocab_size)
    return payload


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


__all__ = ["FORMATS", "HandoffError", "HandoffPlan", "disk_table", "draft_vocab_for", "plan_handoff",
           "specforge_draft_config", "specforge_target", "write_handoff"]
