"""Train an EAGLE-3 draft on a run's speculators hand-off: speculators' own model, loss and data code, our loop.

What is speculators' and what is ours, and why:
- **speculators'** (0.9.0, the consumer the hand-off is judged by): the draft (`Eagle3DraftModel.
  from_training_args`: one decoder layer, the verifier's embeddings, norm and head frozen, 05's
  `d2t`/`t2d`), its loss and per-step accuracies (`forward(..., verifier_last_hidden_states=)`), the
  dataset reader (`ArrowDataset` on `export/speculators/`), the packing sampler
  (`MultipackDistributedBatchSamplerV2`), the collate (`CollateFn`) and the EAGLE-3 shift
  (`shift_batch`), the optimizer builder (`build_optimizers`: Muon on matrices + AdamW, its default)
  and its defaults (3 TTT steps, kl_div, lr 1e-3, norm_before_fc / norm_output / norm_before_residual
  true, linear schedule).
- **ours**: the loop. speculators' `Trainer` calls `model.to(0)` and `torch.accelerator.synchronize()`,
  which fail on a CPU-only torch, and its checkpointer assumes a GPU rank. The loop here is seeded,
  prints one progress line (loss, first-step accuracy, tokens/s, ETA), keeps a checkpoint
  (`value/<variant>/checkpoint.pt`, written atomically every `checkpoint_every` steps and on Ctrl-C),
  resumes from it step-exactly (the sampler's order is a function of seed and epoch) when it was made
  on the same data (`training_identity`: the hand-off's manifest, the rows' keys in order, the settings
  that shape the trajectory) and starts over otherwise, and writes the
  draft with `save_pretrained` into `value/<variant>/draft/`, the folder vLLM loads as an `eagle3`
  speculator. What speculators, transformers and torch log or warn while it trains goes to
  `value/<variant>/peers.log` (`core.peer_logs`), not to the notebook.

The draft's `eagle_aux_hidden_state_layer_ids` come from the store's own recorded layer plan
(`hidden/index.json` `hf_indices`), never from a second rule (`layer_ids_of_store`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from eagle3data.core.errors import UserInputError
from eagle3data.core.peer_logs import PEER_LOG, peers_to_log
from eagle3data.hidden.store.format import INFO_FILE
from eagle3data.value.muon_cpu import muon_ns, resolve_ns_dtype

CHECKPOINT = "checkpoint.pt"
TRAIN_LOG = "train_log.jsonl"
DRAFT_DIR = "draft"


class ValueStageError(UserInputError):
    """Stage 06 cannot go on: the message names the file or setting."""


class ValueStopped(Exception):
    """06 stopped on request (`eagle3data run`'s STOP file, Ctrl-C, SIGTERM): what finished is kept; run it again."""


class TrainingStopped(ValueStopped):
    """A stop during training: the checkpoint holds every finished step."""

    def __init__(self, step: int, total: int, checkpoint: Path):
        super().__init__(f"training stopped at step {step:,} of {total:,}; checkpoint {checkpoint}")
        self.step, self.total, self.checkpoint = step, total, checkpoint


@dataclass
class TrainConfig:
    """One draft's training settings (params `value.train`, identical across variants)."""

    epochs: int = 2
    total_seq_len: int = 2048
    lr: float = 1e-3
    optimizer: str = "muon"
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    loss_fn: str = "kl_div"
    num_layers: int = 1
    seed: int = 0
    max_steps: int | None = None
    checkpoint_every: int = 50
    threads: int | None = None
    muon_ns_dtype: str = "auto"  # Muon's orthogonalization: auto, bfloat16 (torch's), float32 (`muon_cpu`)


@dataclass
class TrainResult:
    draft_dir: Path
    steps: int
    train_tokens: int
    seconds: float
    samples: int
    log: list[dict[str, Any]] = field(default_factory=list)


def layer_ids_of_store(hidden_dir: Path) -> list[int]:
    """The aux layers the store holds, in vLLM's/speculators' convention (HF `hidden_states` indices), from
    `hidden/index.json` (`hf_indices`), the one record of the plan 04 captured with."""
    index = Path(hidden_dir) / INFO_FILE
    try:
        info = json.loads(index.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueStageError(f"{index}: no hidden-state store (run 04 first)") from None
    ids = info.get("hf_indices")
    if not ids or len(ids) != 3:
        raise ValueStageError(f"{index}: field hf_indices: expected the store's 3 aux layer indices, got {ids!r}")
    return [int(i) for i in ids]


def check_draft_layers(draft_dir: Path, store_ids: Sequence[int]) -> None:
    """Refuse a draft whose `eagle_aux_hidden_state_layer_ids` differ from the store's before anything serves it:
    vLLM would load it without a word and feed it other layers than it was trained on."""
    cfg = Path(draft_dir) / "config.json"
    ids = json.loads(cfg.read_text(encoding="utf-8")).get("eagle_aux_hidden_state_layer_ids")
    if list(ids or []) != list(store_ids):
        raise ValueStageError(f"{cfg}: field eagle_aux_hidden_state_layer_ids: {ids} but the store was captured at "
                          f"HF hidden_states {list(store_ids)} (hidden/index.json): a draft served on other layers "
                          "than it trained on accepts nothing")


def _vocab(handoff: Path) -> tuple[Any, Any, int]:
    import numpy as np
    import torch

    d2ts = sorted(handoff.glob("d2t-*.npy"))
    if not d2ts:
        raise ValueStageError(f"{handoff}: no d2t-<N>.npy (run 05 with format speculators)")
    n = int(d2ts[0].stem.split("-")[1])
    d2t = torch.from_numpy(np.load(handoff / f"d2t-{n}.npy")).long()
    t2d = torch.from_numpy(np.load(handoff / f"t2d-{n}.npy")).bool()
    return d2t, t2d, n


def build_draft(model_dir: Path, handoff: Path, layer_ids: Sequence[int], cfg: TrainConfig) -> Any:
    """speculators' Eagle3DraftModel for the target, with 05's vocabulary and the store's layers (fp32)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    d2t, t2d, n = _vocab(handoff)
    vcfg = AutoConfig.from_pretrained(str(model_dir))
    vcfg.num_hidden_layers = cfg.num_layers
    torch.manual_seed(cfg.seed)
    draft = Eagle3DraftModel.from_training_args(
        vcfg, t2d=t2d, d2t=d2t, draft_vocab_size=n, norm_before_residual=True, norm_before_fc=True,
        norm_output=True, ttt_steps=cfg.ttt_steps, verifier_name_or_path=str(model_dir),
        target_layer_ids=list(layer_ids), draft_attn_impl="sdpa")
    return draft.float()


def _loader(handoff: Path, rows: Sequence[int], hidden_size: int, cfg: TrainConfig,
            dataset: Any = None) -> tuple[Any, Any]:
    import torch
    from speculators.models.eagle3 import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from torch.utils.data import DataLoader, Subset

    if dataset is not None:  # a dataset of the hand-off built by the caller (06's online variant: states generated)
        ds = dataset
    else:
        manifest = json.loads((handoff / "handoff.json").read_text(encoding="utf-8"))
        transfer = None
        if manifest.get("hidden_states_backend") == "fp8":  # hs-connectors' FP8 files (speculators' fp8 backend)
            from hs_connectors import FP8Transfer

            transfer = FP8Transfer(handoff / "hidden_states")
        ds = ArrowDataset(max_len=cfg.total_seq_len, datapath=str(handoff), on_missing="raise", transfer=transfer,
                          hidden_states_dtype=torch.float32)
    lengths = [ds.approx_lengths[i] for i in rows]
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=cfg.total_seq_len, lengths=lengths,
                                                 num_replicas=1, rank=0, seed=cfg.seed)
    collate = CollateFn(cfg.total_seq_len, hidden_size, num_target_layers=3, dtype=torch.float32,
                        preprocess=shift_batch)
    return DataLoader(Subset(ds, list(rows)), batch_sampler=sampler, num_workers=0, collate_fn=collate), sampler


def _optimizers(draft: Any, cfg: TrainConfig, total_steps: int) -> tuple[list[Any], list[Any]]:
    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    ns = SimpleNamespace(optimizer=cfg.optimizer, lr=cfg.lr, weight_decay=0.01, muon_lr=cfg.lr, muon_momentum=0.95,
                         muon_weight_decay=0.1, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw")
    opts = build_optimizers(draft, ns)
    warm = max(1, total_steps // 100)  # speculators' default: 1% of the steps
    return opts, [get_linear_schedule_with_warmup(o, warm, total_steps) for o in opts]


TRAJECTORY = ("epochs", "total_seq_len", "lr", "optimizer", "ttt_steps", "ttt_step_loss_decay", "loss_fn",
              "num_layers", "seed", "muon_ns_dtype")  # max_steps, checkpoint_every, threads: a run may stop early and go on


def training_identity(handoff: Path, rows: Sequence[int], cfg: TrainConfig) -> str:
    """What a checkpoint was trained on: the hand-off's manifest (05 rewrites it for other data), the keys of the
    rows in the order given (the packing sampler's batches follow it), and the settings that shape the trajectory."""
    manifest = (Path(handoff) / "handoff.json").read_bytes()
    keys = json.loads(manifest).get("keys") or []
    blob = json.dumps({"manifest": hashlib.blake2b(manifest, digest_size=16).hexdigest(),
                       "rows": [str(keys[i]) if i < len(keys) else i for i in rows],
                       "cfg": {k: getattr(cfg, k) for k in TRAJECTORY}}, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def _save_checkpoint(path: Path, draft: Any, opts: list[Any], scheds: list[Any], step: int, tokens: int,
                     seconds: float, identity: str) -> None:
    import torch

    trainable = {k: v for k, v in draft.state_dict().items() if not k.startswith("verifier_")}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save({"model": trainable, "optimizers": [o.state_dict() for o in opts],
                "schedulers": [s.state_dict() for s in scheds], "step": step, "tokens": tokens,
                "seconds": seconds, "rng": torch.get_rng_state(), "identity": identity}, tmp)
    os.replace(tmp, path)


def train_draft(handoff: Path, model_dir: Path, layer_ids: Sequence[int], out_dir: Path, cfg: TrainConfig,
                rows: Sequence[int], *, say: Callable[[str], None] = print, device: str | None = None,
                stop: Callable[[], bool] | None = None, dataset: Any = None) -> TrainResult:
    """Train one draft on `rows` of the hand-off; resume from `out_dir/checkpoint.pt` when it is there.

    `dataset`: speculators' dataset of the hand-off to read the rows from (default: its ArrowDataset on the stored
    states). A row the dataset could not give (speculators' `SampleUnavailable`, dropped by its collate) stops the
    training with a ValueStageError: a draft is never trained on fewer rows than asked without a word.
    What speculators, transformers and torch log or warn meanwhile goes to `out_dir/peers.log` (`core.peer_logs`),
    not to the notebook or the terminal; `say` gets the training's own lines.
    Returns the saved draft folder and the figures. Ctrl-C, or `stop()` true after a step (the run's STOP file): the
    checkpoint is written and TrainingStopped raised."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with peers_to_log(out_dir / PEER_LOG):
        return _train_draft(handoff, model_dir, layer_ids, out_dir, cfg, rows, say=say, device=device, stop=stop,
                            dataset=dataset)


def _train_draft(handoff: Path, model_dir: Path, layer_ids: Sequence[int], out_dir: Path, cfg: TrainConfig,
                 rows: Sequence[int], *, say: Callable[[str], None], device: str | None,
                 stop: Callable[[], bool] | None, dataset: Any) -> TrainResult:
    import torch
    from torch.utils.data import DataLoader

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = replace(cfg, muon_ns_dtype=resolve_ns_dtype(cfg.muon_ns_dtype, device))  # as resolved: in the identity
    draft = build_draft(model_dir, handoff, layer_ids, cfg).to(device)
    hidden = int(draft.config.transformer_layer_config.hidden_size)
    loader, sampler = _loader(handoff, rows, hidden, cfg, dataset)
    per_epoch = len(sampler)
    total = per_epoch * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, per_epoch * cfg.epochs)
    if total < 1:
        raise ValueStageError(f"{handoff}: no training rows (value.train: {len(rows)} rows)")
    opts, scheds = _optimizers(draft, cfg, total)
    from speculators.losses import resolve_loss_config

    loss_config = resolve_loss_config(cfg.loss_fn, "eager")
    ckpt, log_path = out_dir / CHECKPOINT, out_dir / TRAIN_LOG
    step, tokens, seconds = 0, 0, 0.0
    identity = training_identity(handoff, rows, cfg)
    state = torch.load(ckpt, map_location=device, weights_only=False) if ckpt.exists() else None
    if state is not None and state.get("identity") != identity:
        say(f"{ckpt} was trained on other data, rows or settings: training from the start")
        state = None
    if state is not None:
        draft.load_state_dict(state["model"], strict=False)
        for o, s in zip(opts, state["optimizers"]):
            o.load_state_dict(s)
        for sc, s in zip(scheds, state["schedulers"]):
            sc.load_state_dict(s)
            for g, lr in zip(sc.optimizer.param_groups, sc.get_lr()):  # this run's schedule at the saved step
                g["lr"] = lr
        step, tokens, seconds = int(state["step"]), int(state["tokens"]), float(state["seconds"])
        torch.set_rng_state(state["rng"])
        say(f"resuming from {ckpt} at step {step:,} of {total:,}")
        lines = log_path.read_text(encoding="utf-8").splitlines() if log_path.exists() else []
        log_path.write_text("".join(ln + "\n" for ln in lines[:step]), encoding="utf-8")  # steps after it redone
    else:
        log_path.write_text("", encoding="utf-8")
    draft.train()
    t0, last_say = time.monotonic() - seconds, 0.0
    done_at_start = step
    if cfg.optimizer == "muon" and cfg.muon_ns_dtype == "float32":
        say("Muon's orthogonalization in float32: this CPU has no native bf16 matmul (value.train.muon_ns_dtype)")
    try:
        with open(log_path, "a", encoding="utf-8") as log, muon_ns(cfg.muon_ns_dtype):
            for epoch in range(step // per_epoch, cfg.epochs):
                sampler.set_epoch(epoch)
                skip = step - epoch * per_epoch
                # resumed mid-epoch: the epoch's batches after the checkpoint only (a batch read and skipped would
                # still be read: for the online variant, its rows' states generated for nothing)
                batches = loader if skip <= 0 else DataLoader(loader.dataset, batch_sampler=list(sampler)[skip:],
                                                              num_workers=0, collate_fn=loader.collate_fn)
                for batch in batches:
                    if step >= total:
                        break
                    if batch.get("error_records"):
                        why = getattr(loader.dataset.dataset, "last_error", None) or f"see {out_dir / PEER_LOG}"
                        raise ValueStageError(f"{handoff}: {batch['error_records']} row(s) of step {step + 1:,} were "
                                              f"unavailable to speculators' dataset (last: {why})")
                    n_tok = int((batch["document_ids"] >= 0).sum())
                    inputs = {k: batch[k].to(device) for k in ("hidden_states", "input_ids", "document_ids",
                                                               "loss_mask", "position_ids",
                                                               "verifier_last_hidden_states")}
                    inputs["loss_mask"] = inputs["loss_mask"].bool()
                    _, loss, metrics = draft(**inputs, ttt_steps=cfg.ttt_steps,
                                             ttt_step_loss_decay=cfg.ttt_step_loss_decay, loss_config=loss_config)
                    loss.backward()
                    for o in opts:
                        o.step()
                        o.zero_grad(set_to_none=True)
                    for s in scheds:
                        s.step()
                    step += 1
                    tokens += n_tok
                    row = {"step": step, "epoch": epoch, "loss": round(loss.item(), 5), "tokens": tokens,
                           "lr": scheds[0].get_last_lr()[0]}
                    for k in range(cfg.ttt_steps):
                        tot = float(metrics[f"full_acc_{k}_total"])
                        row[f"full_acc_{k}"] = round(float(metrics[f"full_acc_{k}_sum"]) / tot, 4) if tot else None
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    el = time.monotonic() - t0
                    if step % cfg.checkpoint_every == 0 or step == total:
                        _save_checkpoint(ckpt, draft, opts, scheds, step, tokens, el, identity)
                    if stop is not None and step < total and stop():
                        raise KeyboardInterrupt  # the same path as Ctrl-C: checkpoint, TrainingStopped
                    if time.monotonic() - last_say > 10 or step == total:
                        last_say = time.monotonic()
                        rate = tokens / el if el else 0.0
                        left = (total - step) * (el - seconds) / max(1, step - done_at_start)
                        say(f"train {step:,}/{total:,} · loss {row['loss']:.3f} · acc0 {row['full_acc_0']} · "
                            f"{rate:,.0f} tok/s · ETA {int(left) // 60}:{int(left) % 60:02d}")
    except KeyboardInterrupt:
        _save_checkpoint(ckpt, draft, opts, scheds, step, tokens, time.monotonic() - t0, identity)
        raise TrainingStopped(step, total, ckpt) from None
    draft_dir = out_dir / DRAFT_DIR
    draft.eval()
    draft.save_pretrained(str(draft_dir))
    check_draft_layers(draft_dir, layer_ids)
    log_rows = [json.loads(x) for x in log_path.read_text(encoding="utf-8").splitlines() if x.strip()]
    return TrainResult(draft_dir, step, tokens, round(time.monotonic() - t0, 1), len(rows), log_rows)


def load_draft(draft_dir: Path, device: str = "cpu") -> Any:
    """A saved draft for offline evaluation (speculators' own from_pretrained: the verifier's frozen weights reloaded;
    what it logs meanwhile to `peers.log` beside the draft folder)."""
    with peers_to_log(Path(draft_dir).parent / PEER_LOG):
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

        cfg = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
        cfg.transformer_layer_config._attn_implementation = "sdpa"  # dense masks of any length (flex's are fixed-size)
        return Eagle3DraftModel.from_pretrained(str(draft_dir), config=cfg).float().to(device).eval()
