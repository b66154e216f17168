"""SpecForge (0.2.0): post-norm final state, `.ckpt` per sample, `features/`, `vocab_mapping.pt`, `specforge.yaml`.

Checked against the released code: `specforge train -c CONFIG` reads `data.hidden_states_path`
through `specforge.data.preprocessing.build_offline_eagle3_dataset` and
`runtime.data_plane.offline_reader.OfflineManifestReader`: one torch file per sample,
`features/<row, 9 digits>.ckpt` (the loader sorts paths as text), holding `input_ids` and
`loss_mask` (int64 [n]), `hidden_state` [1, n, H] (the **post-norm** final state: its target
head is a bare `lm_head`) and `aux_hidden_state` [1, n, 3H]; 04's per-sample file (layout
`specforge`) is that file, plus `pre_norm` [1, n, H] when stored and its `eagle3data`
description. Beside the features: `vocab_mapping.pt` `{d2t int64, t2d bool}` for
`model.vocab_mapping_path`; `specforge.yaml`, a config for `specforge train` whose target head
SpecForge loads itself (`specforge_target`: the model folder, or `target/` beside it when the
folder has no weight index; the head's key, the embedding's when the model ties them), and
`draft_config.json` when the draft vocabulary is not SpecForge's generated 32000.

The folder is self-contained: every path in `specforge.yaml` is relative to it, and SpecForge
resolves relative paths from the working directory (its `load_config` takes them as written), so
it trains from there (`cd export/specforge && specforge train -c specforge.yaml`) wherever the
folder was copied. The target model is the one link `model` (its folder on the exporting machine;
`target/`'s links go through it): on another machine `ln -sfn /path/to/model model` is all there
is to set.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import orjson

from eagle3data.core.atomic import atomic_path
from eagle3data.trainers.base import AUX_STATES, HandoffError, Trainer

FEATURES = "features"  # the per-sample files, under the hand-off folder
VOCAB_FILE = "vocab_mapping.pt"
CONFIG_FILE = "specforge.yaml"
TARGET_DIR = "target"  # the model folder as SpecForge reads it, when the folder itself has no weight index
MODEL_LINK = "model"  # the one link to the target model's folder: what a user re-points on another machine
CONFIG_HEADER = """\
# SpecForge 0.2.0 config written by `eagle3data export`. Every path is relative to this folder
# (SpecForge resolves relative paths from the working directory): train from here,
#   cd path/to/this/folder && specforge train -c specforge.yaml [dotted.overrides=...]
# The target model is the link `model` ({model}); on another machine point it at the
# model's folder there, the one path to set:  ln -sfn /path/to/model model
"""
DRAFT_CONFIG = "draft_config.json"
DRAFT_VOCAB = 32000  # draft_vocab_size of the EAGLE-3 draft config SpecForge 0.2.0 generates
HEAD_KEY, EMBED_KEY = "lm_head.weight", "model.embed_tokens.weight"  # SpecForge's defaults for both keys


class SpecForge(Trainer):
    """SpecForge's offline EAGLE-3: post-norm `hidden_state`, aux states concatenated, ids and mask int64."""

    name = "specforge"
    final_state = "post_norm"
    sample_suffix = ".ckpt"
    id_mask_bytes = 8 + 8  # input_ids and loss_mask int64, as its own capture writes them
    handoff_dir = FEATURES
    export_files = ("conversations.jsonl", "token_ids.jsonl")

    def handoff_name(self, row: int) -> str:
        return f"{row:09d}.ckpt"

    def write_sample(self, path: Path, input_ids: Any, loss_mask: Any, aux: Any, finals: dict[str, Any],
                     meta: str | None = None, *, tmp_suffix: str = ".tmp", storage: Any = None) -> int:
        import torch

        if storage is not None:
            raise HandoffError(f"{path}: SpecForge reads bf16 features only, not {storage.name}: store shards "
                               "(hidden.layout shards) and let 05 convert")
        n = len(input_ids)
        path.parent.mkdir(parents=True, exist_ok=True)
        obj: dict[str, Any] = {"input_ids": torch.as_tensor(input_ids, dtype=torch.long).clone(),
                               "loss_mask": torch.as_tensor(loss_mask, dtype=torch.long).clone(),
                               "hidden_state": finals["post_norm"].contiguous().clone()[None],
                               "aux_hidden_state": aux.reshape(n, -1).contiguous().clone()[None]}
        if "pre_norm" in finals:
            obj["pre_norm"] = finals["pre_norm"].contiguous().clone()[None]
        if meta is not None:
            obj["eagle3data"] = meta
        with atomic_path(path, tmp_suffix=tmp_suffix, fsync=True) as tmp:
            torch.save(obj, str(tmp))
        return path.stat().st_size

    def _load(self, path: Path) -> Any:
        import torch

        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)

    def read_sample(self, path: Path) -> dict[str, Any]:
        raw = self._load(path)
        n = raw["input_ids"].shape[-1]
        finals = {"post_norm": raw["hidden_state"][0]}
        if "pre_norm" in raw:
            finals["pre_norm"] = raw["pre_norm"][0]
        return {"input_ids": raw["input_ids"], "loss_mask": raw["loss_mask"],
                "aux": raw["aux_hidden_state"][0].reshape(n, AUX_STATES, -1), "finals": finals}

    def read_ids(self, path: Path) -> tuple[list[int], list[int]]:
        raw = self._load(path)
        return raw["input_ids"].tolist(), raw["loss_mask"].tolist()

    def read_meta(self, path: Path) -> str | None:
        raw = self._load(path)
        return raw["eagle3data"] if isinstance(raw, dict) and "eagle3data" in raw else None

    def write_export_vocab(self, out: Path, d2t: Any, t2d: Any, counts: Any) -> dict[str, str]:
        save_vocab_mapping(out / VOCAB_FILE, d2t, t2d)
        return {VOCAB_FILE: "torch dict {d2t, t2d}: SpecForge's vocab mapping file"}

    def write_handoff_files(self, out: Path, samples: Sequence[Any], d2t: Any, t2d: Any, params: Any,
                            model_dir: Callable[[], Path | None]) -> tuple[dict[str, str], dict[str, Any]]:
        save_vocab_mapping(out / VOCAB_FILE, d2t, t2d)
        files = {VOCAB_FILE: "{d2t int64 (target = draft + d2t), t2d bool}: model.vocab_mapping_path",
                 FEATURES + "/": ("one torch file per row: input_ids, loss_mask int64 [n], hidden_state [1,n,H] "
                                  "post-norm, aux_hidden_state [1,n,3H]: data.hidden_states_path")}
        target = write_config(params, model_dir(), out, max(len(s.input_ids) for s in samples) if samples else 1,
                               int(len(d2t)))
        files[CONFIG_FILE] = ("a config for `specforge train -c specforge.yaml`, run from this folder: its paths are "
                              "relative (edit training settings)")
        if target.get("link"):
            files[MODEL_LINK] = "a link to the target model's folder: the one path to set on another machine"
        if target.get("view"):
            files[TARGET_DIR + "/"] = (f"links (through `model`) to the target's files plus {target['index']} "
                                       "(SpecForge's TargetHead reads weights only through an index): "
                                       "model.target_model_path")
        if target.get("draft_config"):
            files[DRAFT_CONFIG] = (f"EAGLE-3 draft config, draft_vocab_size {len(d2t)} (SpecForge generates "
                                   f"{DRAFT_VOCAB}): model.draft_model_config")
        return files, {"specforge_target": target}


def save_vocab_mapping(path: Path, d2t: Any, t2d: Any) -> None:
    """`vocab_mapping.pt`: the torch dict {d2t int64, t2d bool} SpecForge's `load_vocab_mapping` reads."""
    import numpy as np
    import torch

    d2t = np.ascontiguousarray(d2t, dtype=np.int64)
    t2d = np.ascontiguousarray(t2d, dtype=bool)
    torch.save({"d2t": torch.from_numpy(d2t.copy()), "t2d": torch.from_numpy(t2d.copy())}, path)


def write_config(params: Any, model_dir: Path | None, out: Path, longest: int, draft_vocab_size: int, *,
                 data: dict[str, Any] | None = None, model_extra: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`specforge.yaml`: offline EAGLE-3 training on these features with this vocabulary (SpecForge 0.2.0 schema).

    `model_dir`: the target's folder (None: not on this machine). Returns what the config says
    about the target (`specforge_target` in the manifest). `data`, `model_extra`, `extra`: the
    online hand-off's data section (`prompts_path`), model keys and top-level sections (`deployment`)
    in place of the offline features (`export/online.py`).
    """
    import yaml

    trust = bool(params.model.trust_remote_code)
    if model_dir is None:
        target: dict[str, Any] = {
            "model_dir": params.model.path, "target_model_path": params.model.path, "view": False,
            "lm_head_key": HEAD_KEY, "embedding_key": EMBED_KEY, "tied": None,
            "note": "the model folder is not on this machine: SpecForge's defaults kept, unchecked (the folder needs "
                    "a *.index.json naming lm_head_key; a tied model needs lm_head_key model.embed_tokens.weight)"}
        _clear(out / TARGET_DIR)
        _clear(out / MODEL_LINK)
    else:
        target = specforge_target(model_dir, out)
    draft = out / DRAFT_CONFIG
    target["draft_config"] = None
    draft.unlink(missing_ok=True)
    if draft_vocab_size != DRAFT_VOCAB and model_dir is not None:
        payload = specforge_draft_config(model_dir, draft_vocab_size, trust_remote_code=trust)
        draft.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
        target["draft_config"] = DRAFT_CONFIG
    elif draft_vocab_size != DRAFT_VOCAB:
        target["note"] += (f"; no draft config written: SpecForge generates draft_vocab_size {DRAFT_VOCAB}, "
                           f"this vocabulary has {draft_vocab_size} (set model.draft_model_config)")
    model: dict[str, Any] = {"target_model_path": target["target_model_path"]}
    if target["draft_config"]:
        model["draft_model_config"] = target["draft_config"]
    model.update({"embedding_key": target["embedding_key"], "lm_head_key": target["lm_head_key"],
                  "vocab_mapping_path": VOCAB_FILE, "trust_remote_code": trust})
    model.update(model_extra or {})
    cfg = {  # relative to this folder, where `specforge train` runs (module docstring)
        "model": model,
        "data": data or {"hidden_states_path": FEATURES, "max_length": int(longest)},
        "training": {"strategy": "eagle3"},
        **(extra or {}),
        "output_dir": "train_output",
    }
    header = CONFIG_HEADER.format(model=f"exported with {model_dir}" if model_dir is not None else
                                  f"not made: the model was not on the exporting machine, so model.target_model_path is "
                                  f"{params.model.path}")
    (out / CONFIG_FILE).write_text(header + yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
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


def specforge_target(model_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """The folder `model.target_model_path` names (relative to the hand-off folder `out_dir`) and the head/embedding
    keys, as SpecForge 0.2.0 loads them.

    SpecForge's offline EAGLE-3 builds `TargetHead.from_pretrained(target_model_path,
    lm_head_key=...)`, which reads the head only through the folder's one `*.index.json`
    weight map (`specforge/modeling/target/target_head.py`): a single-file checkpoint (one
    `model.safetensors`, as `prepare-model` and most small models ship) has none. The same
    path also gives SpecForge the target config (`AutoConfig`: hidden and vocabulary sizes, the
    generated draft config), the tokenizer when it needs one, the draft's frozen embedding
    (`load_embedding(path, embedding_key)`) and its resume provenance, so it must stay the
    whole model folder, reached through the one link `out_dir/model` (MODEL_LINK: the path a user
    re-points on another machine). With exactly one index, `model` is used as it is. Otherwise
    (none, or several, which SpecForge refuses) `out_dir/target` becomes that folder without being
    a copy: a relative symlink `../model/<entry>` to every entry of the model folder except its
    indexes, plus one index whose weight map names every tensor of the checkpoint. The model folder itself is never written
    (a hub cache or a shared read-only folder). A model that ties its head to the embeddings
    stores no `lm_head.weight`: `lm_head_key` is then the embedding's key, the matrix the
    model multiplies by.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    view_dir, link = out_dir / TARGET_DIR, out_dir / MODEL_LINK
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_link = link.with_name(link.name + ".tmp")
    _clear(tmp_link)
    os.symlink(os.path.abspath(model_dir), tmp_link)
    os.replace(tmp_link, link)  # a link of an earlier export replaced in one step (a folder there is refused)
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
                os.symlink(f"../{MODEL_LINK}/{entry.name}", tmp / entry.name)  # through the one link
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
    return {"model_dir": str(model_dir), "target_model_path": TARGET_DIR if view else MODEL_LINK, "link": MODEL_LINK,
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
