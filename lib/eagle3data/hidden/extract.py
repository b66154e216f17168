"""Stage 04: EAGLE-3 hidden states of the training mix, captured and handed to the store (`store/`).

For every token of prompt + output the drafter trains on the states of the target: the
outputs of three decoder layers chosen by the profile's rule (`profiles.aux_layers` on the
model's real layer count) and the final state (`hidden.final_state`): `pre_norm`, the output
of the last decoder layer (speculators applies the verifier's norm itself), `post_norm`, the
final norm's output exactly as the model computes it (SpecForge's target head is a bare
`lm_head`), or `both` (the default). Post-norm is norm(pre-norm) in the model's own compute
dtype; from a stored bf16 pre-norm it can only be recomputed approximately, so a run for
SpecForge stores it. They are captured with forward hooks on those layers, the last layer
and the final norm during a forward of the decoder alone (no LM head, no copy of the other
layers), batched by a token budget over sequences of similar length; padding is computed
but never stored. Which states a store holds is recorded in every file's metadata and in
`index.json` (`states`, `final_state`, `layout`).

On disk (`<run>/hidden/` or `hidden.out_dir`): the mix (`mix.py`), then the store: shards or
one file per sample in a trainer's own format (`hidden.layout`), and the one index; the store's
files are written and read by the `store` package alone (its docstring describes them); this module
captures the states (the HF forward: `capture.py`; an engine: `engines/`) and hands them to the store's writers.

One plan: `plan_extract(params)` builds the mix once, with the model's context limit (longer
samples are dropped as `too_long`, never fed to the model), the layer plan, this worker's work
and its estimate; `run_extract(params, plan=plan)` executes exactly that plan, and
`run_extract(params)` is `run_extract(params, plan=plan_extract(params))`; the notebook calls them, showing the plan.

Workers: `RANK`/`WORLD_SIZE` (as `torchrun` sets them) pick a deterministic disjoint part of
the mix (mix position modulo world size); each writes its own shards; the worker that finds
every sample stored merges the one index (`merge_index` does it on demand).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3data.core.models import context_limit, text_config
from eagle3data.core.params import RunParams
from eagle3data.core.profiles import AuxLayers
from eagle3data.core.progress import Progress, fmt_duration, fmt_tokens
from eagle3data.core.reader import Sample
from eagle3data.hidden.estimate import Estimate, check_disk, estimate_work
from eagle3data.hidden.mix import Mix, build_mix, hidden_dir, read_mix
from eagle3data.hidden.capture import (Capture, _sync, layer_plan, load_config, load_extract_model, pad_batch,
                                      plan_batches, probe)
from eagle3data.hidden.store.format import HiddenError, _torch_dtype, stored_bytes_per_token, state_names
from eagle3data.hidden.store.index import ShardScan, StoredMatch, match_stored, scan_shards
from eagle3data.hidden.store.validation import Validation, validate_store
from eagle3data.hidden.store.writer import open_writer
from eagle3data.core.provenance import write_provenance
from eagle3data.hidden.engines.sglang_capture import capture_sglang, sglang_layers_note
from eagle3data.hidden.engines.vllm_capture import capture_vllm, holds_vllm_server, vllm_layers_note
from eagle3data.hidden.verify.run import VerifyResult, verify_store
from eagle3data.hidden.merge import IncompleteError, merge_store
from eagle3data.hidden.store.failures import (SamplesFailed, accepted_failures, accepted_line, clear_failures,
                                              failed_line, hf_failure, require_samples, short, write_failures)
from eagle3data.hidden.verify.sglang import sglang_backend
from eagle3data.hidden.verify.vllm import vllm_backend

STAGE = "04_extract_hidden"

# ---------------------------------------------------------------------------- environment


def dist_env() -> tuple[int, int]:
    """(rank, world_size) from the torch.distributed environment (`torchrun` sets RANK/WORLD_SIZE)."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise HiddenError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                          "must be integers") from None
    if world < 1 or not 0 <= rank < world:
        raise HiddenError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    return rank, world


# ---------------------------------------------------------------------------- run


class _ExtractLine:
    """04's live line (notebook, terminal, `progress.json` for `eagle3data run`): samples, tokens, rate, ETA."""

    def __init__(self, rank: int, samples: int, tokens: int, progress: Any):
        self.rank, self.samples, self.tokens, self.progress = rank, samples, tokens, progress
        self._last = 0.0

    def update(self, stats: dict[str, Any], elapsed: float, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < 1.0:
            return
        self._last = now
        done = stats["tokens"]
        rate = done / elapsed if elapsed > 0 and done else None
        eta = (self.tokens - done) / rate if rate else None
        parts = [f"extract r{self.rank} {stats['extracted']:,}/{self.samples:,} samples",
                 f"{fmt_tokens(done)}/{fmt_tokens(self.tokens)} tok"]
        if rate:
            parts.append(f"{rate:,.0f} tok/s")
        parts.append(f"elapsed {fmt_duration(elapsed)}")
        if not final and eta is not None:
            parts.append(f"ETA {fmt_duration(eta)}")
        if stats.get("stop_reason"):
            parts.append(f"stopped: {stats['stop_reason']}")
        self.progress.update(" · ".join(parts), final=final,
                             figures={"samples": self.samples, "extracted": stats["extracted"], "tokens": done,
                                      "planned_tokens": self.tokens, "tokens_per_s": rate, "eta_s": eta})


@dataclass
class WorkPlan:
    """This worker's share of the mix: samples still to extract (not stored, or stored with other ids: `stored`),
    and those too long for the model."""

    rank: int
    world_size: int
    part: list[tuple[int, Sample]]
    todo: list[tuple[int, Sample]]
    too_long: list[dict[str, Any]]
    max_context: int
    scan: ShardScan
    stored: StoredMatch


def plan_work(params: RunParams, mix: Mix, *, rank: int, world_size: int) -> WorkPlan:
    """Split the mix for this rank and leave out samples already in finished shards with their mix ids (reads headers
    only: each copy's ids digest, `index.match_stored`); a sample stored with other ids is extracted again.

    Too-long sequences never reach here: the mix drops them (`too_long`, reported with the plan).
    """
    hdir = hidden_dir(params)
    max_ctx = (mix.manifest.get("settings") or {}).get("max_context") or 0  # the limit the mix was built with
    part = [(i, s) for i, s in enumerate(mix.samples) if i % world_size == rank]
    too_long = [d for d in mix.dropped if d["reason"] == "too_long"]
    scan = scan_shards(hdir)  # deletes nothing: run_extract discards partial files when it executes the plan
    scan.check_kind(params.hidden.layout, state_names(params.hidden.final_state), hdir, params.hidden.codec())
    stored = match_stored(scan, [s for _, s in part])
    todo = [(i, s) for i, s in part if s.key not in stored.chosen]
    return WorkPlan(rank, world_size, part, todo, too_long, max_ctx, scan, stored)


@dataclass
class ExtractPlan:
    """Stage 04's one plan: made once by `plan_extract`, shown by the notebook, executed as is by `run_extract`.

    `mix`: the training mix, built with the model's context limit (`models.context_limit`; longer
    samples dropped as `too_long`) and written once to `hidden/mix.parquet`: nothing after
    `plan_extract` rebuilds or rewrites it. `layers`: the profile's layers on the model's real
    layer count. `work`: this worker's share and what is left of it. `estimate`: bytes and free
    disk for `work.todo` and, when a model was at hand, the timed probe. `model`: the model that
    executes the plan (None when nothing is left, the disk lacks room, or it was not to be loaded).
    """

    params: RunParams = field(repr=False)
    rank: int
    world_size: int
    config: Any = field(repr=False)
    max_context: int | None
    mix: Mix = field(repr=False)
    layers: AuxLayers
    work: WorkPlan = field(repr=False)
    estimate: Estimate
    model: Any = field(default=None, repr=False)
    executed: bool = False

    def layers_line(self) -> str:
        """The layers captured, in both conventions (HF `hidden_states` index and decoder layer outputs)."""
        lay, hp = self.layers, self.params.hidden
        return (f"{lay.num_layers} decoder layers: HF hidden_states index {list(lay.hf_indices)} "
                f"= outputs of layers {list(lay.layer_outputs)}, then the final state: {hp.final_state} "
                f"(pre_norm = output of the last layer, post_norm = the final norm's output); layout {hp.layout}"
                + (vllm_layers_note(lay) if hp.backend == "vllm" else "")
                + (sglang_layers_note(lay, self.config) if hp.backend == "sglang" else ""))

    def context_line(self) -> str:
        """The context limit the mix was built with, and what it dropped."""
        n = sum(1 for d in self.mix.dropped if d["reason"] == "too_long")
        if not self.max_context:
            return "context limit: none known (no model.max_context, no max_position_embeddings): none too long"
        return (f"context limit: {self.max_context:,} tokens (prompt + output); "
                f"{n} sample{'s' if n != 1 else ''} longer dropped as too_long, never truncated")


def plan_extract(params: RunParams, *, model: Any = None, load_model: bool = True) -> ExtractPlan:
    """Stage 04's one plan for this worker: the mix (written once), the layers, the work left and its estimate.

    The mix is built with the model's context limit, so the samples the model cannot take are
    dropped (`too_long`) before anything is planned: the estimate, the extraction, the index
    and 05 all see this one mix. Reads shard headers only and deletes nothing. With work to do,
    room on the disk and `load_model`, the target model is loaded (unless given) and
    `hidden.probe_batches` batches are timed; `run_extract(params, plan=plan)` then executes
    exactly this plan with that model.
    """
    rank, world = dist_env()
    config = model.config if model is not None else load_config(params)
    max_ctx = context_limit(params, config)
    mix = build_mix(params, max_context=max_ctx)  # written once: nothing below rebuilds or rewrites it
    layers = layer_plan(params, config)
    work = plan_work(params, mix, rank=rank, world_size=world)
    est = estimate_work(params, work, int(text_config(config).hidden_size), mix)
    if model is None and load_model and work.todo and est.fits and params.hidden.backend == "hf":
        model = load_extract_model(params)
    if model is not None and work.todo and params.hidden.probe_batches > 0:
        seqs = [s.input_ids for _, s in work.todo]
        batches = plan_batches([len(x) for x in seqs], params.hidden.batch_tokens)
        with Capture(model, layers, _torch_dtype(params.hidden.dtype), params.hidden.final_state) as cap:
            est.probe_tokens, est.probe_seconds = probe(cap, seqs, batches, params.hidden.probe_batches)
    return ExtractPlan(params, rank, world, config, max_ctx, mix, layers, work, est, model)


def estimate(params: RunParams, *, model: Any = None) -> Estimate:
    """Size of what this worker still has to extract, the free disk, and (given a model) a timed probe.

    The estimate of a plan of its own (`plan_extract(params, model=model, load_model=False)`;
    it writes the same mix a run would): to look before running. The estimate of the plan a
    run executes is `plan.estimate`. Reads nothing but headers and deletes nothing.
    """
    return plan_extract(params, model=model, load_model=False).estimate


@dataclass
class ExtractResult:
    """What one worker did, and (when it merged) the index and the validation of the whole store."""

    hidden_dir: Path
    rank: int
    world_size: int
    mix_manifest: dict[str, Any]
    estimate: Estimate | None
    stats: dict[str, Any]
    too_long: list[dict[str, Any]]
    merged: bool
    index: Any = None
    validation: "Validation | None" = None
    verification: VerifyResult | None = None  # verify-hidden's pass at the end (`hidden.verify_after`)
    waiting_for: int = 0
    plan: ExtractPlan | None = field(default=None, repr=False)  # the plan executed (its mix, layers, estimate)

    def table(self):
        """Per dataset (from the merged index): samples, tokens, trained tokens and bytes stored."""
        import pandas as pd

        if self.index is None or not len(self.index):
            return pd.DataFrame(columns=["samples", "tokens", "loss_tokens", "bytes"])
        bpt = stored_bytes_per_token(self.stats)
        g = self.index.groupby("dataset").agg(samples=("sample_id", "size"), tokens=("length", "sum"),
                                              loss_tokens=("loss_tokens", "sum"))
        g["bytes"] = g["tokens"] * bpt
        return g

    def stats_table(self):
        """This worker's throughput, padding and resume counts."""
        import pandas as pd

        return pd.DataFrame({"value": pd.Series(self.stats, dtype=object)})

    def too_long_table(self):
        """Sequences skipped because they exceed the model's context (never truncated)."""
        import pandas as pd

        return pd.DataFrame(self.too_long, columns=["dataset", "sample_id", "tokens", "max_context"])

    def figures(self) -> dict[str, Any]:
        """Key numbers for the notebook's `figures` cell."""
        v = self.validation
        return {
            "samples": int(len(self.index)) if self.index is not None else None,
            "tokens": int(self.index["length"].sum()) if self.index is not None else None,
            "too_long": len(self.too_long),
            "pad_fraction": self.stats.get("pad_fraction"),
            "tokens_per_s": self.stats.get("tokens_per_s"),
            "estimated_bytes": self.estimate.bytes if self.estimate else None,
            "validation_problems": None if v is None else len(v.problems),
            "verify_failed_samples": None if self.verification is None else self.verification.summary["failed_samples"],
            "merged": self.merged,
        }


@holds_vllm_server  # hidden.backend vllm: one server through the capture and the verify's recompute
def run_extract(params: RunParams, progress: bool = True, *, model: Any = None, plan: ExtractPlan | None = None,
                max_new_shards: int | None = None) -> ExtractResult:
    """Stage 04 for this worker: execute one plan (refuse if the disk is short), extract, merge, validate.

    `plan`: what `plan_extract(params)` made (the notebook shows it first); without one, this
    makes it: `run_extract(params)` is `run_extract(params, plan=plan_extract(params, model=model))`.
    Exactly the plan's mix and work are extracted, with its layers and its model; the mix is
    not rebuilt or rewritten, the index is merged and validated against it. A plan runs once.
    `max_new_shards` stops after writing that many shards (to bound a session; resume later).
    """
    plan = plan_extract(params, model=model) if plan is None else plan
    wrong = ("has run already: make a new one to resume" if plan.executed
             else "was made for other params" if plan.params != params
             else "holds another model than the one given" if model is not None and plan.model not in (None, model)
             else f"is for rank {plan.rank} of {plan.world_size}, this worker is rank {dist_env()[0]} of "
                  f"{dist_env()[1]}" if (plan.rank, plan.world_size) != dist_env() else None)
    if wrong:
        raise HiddenError(f"the extraction plan {wrong} (plan_extract makes the plan run_extract executes)")
    plan.executed = True
    hp = params.hidden
    hdir = hidden_dir(params)
    rank, world = plan.rank, plan.world_size
    config, mix, layers, work, est = plan.config, plan.mix, plan.layers, plan.work, plan.estimate
    if rank == 0:
        write_provenance(params.run_dir, STAGE, params)
    require_samples(mix, hdir)  # every record dropped: nothing to store is a failed stage (MixEmpty, one line)
    check_disk(est, hdir)
    # what a crash left: this worker's partial files (every worker's when alone); the plan never counted them as done
    discarded = scan_shards(hdir, discard_for_rank=rank, discard_all=world == 1).discarded
    clear_failures(hdir, rank, world)  # this run tries those samples again: its own failures are recorded below

    stats: dict[str, Any] = {
        "rank": rank, "world_size": world, "samples_in_part": len(work.part),
        "already_stored": len(work.part) - len(work.todo),
        "to_extract": len(work.todo), "too_long": len(work.too_long),
        "partial_shards_discarded": len(discarded), "hidden_size": int(text_config(config).hidden_size),
        "dtype": hp.dtype, "layers_hf_indices": list(layers.hf_indices),
        "layers_outputs": list(layers.layer_outputs), "num_layers": layers.num_layers,
        "states": list(state_names(hp.final_state)), "layout": hp.layout, "storage": hp.codec().as_dict(),
        "extracted": 0, "tokens": 0, "computed_tokens": 0, "padded_tokens": 0, "batches": 0, "shards_written": 0,
        "seconds": 0.0, "tokens_per_s": None, "pad_fraction": None, "stopped_early": False,
    }
    if work.stored.stale:  # stored with other ids than the mix's: in `todo`, extracted again (a clean run: no row)
        stats["stale_reextracted"] = len(work.stored.stale)
    if progress and (said := work.stored.line()):
        print(said, flush=True)
    info = {"model": params.model.name, "profile": params.profile, "hidden_size": stats["hidden_size"],
            "dtype": hp.dtype, "num_layers": layers.num_layers, "hf_indices": list(layers.hf_indices),
            "layer_outputs": list(layers.layer_outputs), "states": list(state_names(hp.final_state)),
            "final_state": hp.final_state, "layout": hp.layout, "storage": stats["storage"], "mix_fingerprint": mix.manifest.get("fingerprint")}
    failures: list[dict[str, Any]] = []  # samples not stored after their retries (every backend), with the error
    ledgers: list[str] = []  # the engine's own ledgers that hold them
    if work.todo and hp.backend == "vllm":  # a vLLM server computes the states (engines/vllm_capture.py); same writer
        failures, ledgers = capture_vllm(params, work.todo, open_writer(hdir, rank, hp.layout, hp.shard_bytes, info),
                                         stats, layers=layers, config=config, progress=progress)
    elif work.todo and hp.backend == "sglang":  # two SGLang passes, aux then final (engines/sglang_capture.py)
        failures, ledgers = capture_sglang(params, work.todo, open_writer(hdir, rank, hp.layout, hp.shard_bytes, info),
                                           stats, layers=layers, config=config, progress=progress)
    elif work.todo:
        import torch

        if plan.model is None:  # a plan made without loading it
            plan.model = model if model is not None else load_extract_model(params)
        model = plan.model
        with Capture(model, layers, _torch_dtype(hp.dtype), hp.final_state) as cap:
            seqs = [s.input_ids for _, s in work.todo]
            batches = plan_batches([len(x) for x in seqs], hp.batch_tokens)
            if not est.probe_seconds:  # timed once: by the plan when it had the model, else here
                est.probe_tokens, est.probe_seconds = probe(cap, seqs, batches, hp.probe_batches)
            writer = open_writer(hdir, rank, hp.layout, hp.shard_bytes, info)
            pad_id = int(getattr(text_config(config), "pad_token_id", None) or 0)
            total_tokens = sum(len(x) for x in seqs)
            line = _ExtractLine(rank, len(seqs), total_tokens, Progress(progress, run_dir=params.run_dir,
                                                                         stage=STAGE))
            t0 = time.perf_counter()
            try:
                for b in batches:
                    ids, mask = pad_batch([seqs[i] for i in b], pad_id)
                    try:
                        states = cap.run(ids, mask).cpu()
                    except Exception as e:  # noqa: BLE001 - a forward that raised (out of memory, ...) fails its batch
                        for i in b:
                            failures.append(hf_failure(work.todo[i][1], f"forward raised {type(e).__name__}: "
                                                        f"{short(e)}"))
                        line.update(stats, time.perf_counter() - t0)
                        continue
                    stats["batches"] += 1
                    stats["padded_tokens"] += ids.numel()
                    stats["computed_tokens"] += sum(len(seqs[i]) for i in b)
                    for r, i in enumerate(b):
                        pos, s = work.todo[i]
                        one = states[r, : len(s.input_ids)]
                        if not bool(torch.isfinite(one).all()):
                            failures.append(hf_failure(s, f"hidden states hold {int((~torch.isfinite(one)).sum())} "
                                                           "NaN or inf values"))
                            continue
                        writer.add(s, pos, one.clone())
                        stats["extracted"] += 1
                        stats["tokens"] += len(s.input_ids)
                        if max_new_shards is not None and len(writer.written) >= max_new_shards:
                            stats["stopped_early"] = True
                            break
                    del states
                    line.update(stats, time.perf_counter() - t0)
                    if not stats["stopped_early"] and (params.run_dir / "STOP").exists():
                        writer.flush()  # graceful stop (Ctrl-C on `eagle3data run`, `eagle3data stop`): the shard in progress is written
                        stats["stopped_early"] = True
                        stats["stop_reason"] = "STOP file"
                    if stats["stopped_early"]:
                        break
                if not stats["stopped_early"]:
                    writer.flush()
            finally:
                line.update(stats, time.perf_counter() - t0, final=True)
            _sync()
            stats["seconds"] = round(time.perf_counter() - t0, 3)
            stats["shards_written"] = len(writer.written)
            # samples still queued when stopping early are not stored: count what is on disk
            stats["extracted"] -= len(writer.entries)
            stats["tokens"] -= writer.tokens
            if failures:  # (a clean HF run's stats keep their rows: the golden notebook shows them)
                stats.update(failed=len(failures), failures=failures[:50])
    if stats["padded_tokens"]:
        stats["pad_fraction"] = round(1 - stats["computed_tokens"] / stats["padded_tokens"], 4)
    if stats["seconds"]:
        stats["tokens_per_s"] = round(stats["computed_tokens"] / stats["seconds"], 1)

    result = ExtractResult(hdir, rank, world, mix.manifest, est, stats, work.too_long, merged=False, plan=plan)
    path = write_failures(hdir, rank, world, failures, backend=hp.backend, ledgers=ledgers, tried=len(work.todo))
    if stats["stopped_early"]:
        return result
    if len(failures) > hp.allow_failed_samples:  # a sample the engine failed is a failed stage: nothing merged
        raise SamplesFailed(failed_line(failures, len(work.todo), path, ledgers, hp.allow_failed_samples), result)
    try:
        index = merge_index(params, mix=mix, config=config)
    except IncompleteError as e:
        if world == 1:  # no other worker to wait for: what this run left unstored is a failed stage
            raise SamplesFailed(f"{e}; ledger: {path or 'none (no sample of this run failed)'}", result) from None
        result.waiting_for = e.missing
        return result
    result.merged = True
    result.index = index
    if accepted := accepted_failures(hdir):  # failed samples accepted (allow_failed_samples): out of the mix
        mix = read_mix(hdir)
        result.mix_manifest, stats["failed_accepted"] = mix.manifest, accepted
        print(accepted_line(accepted, hp.allow_failed_samples), flush=True) if progress else None
    if hp.validate_after:
        result.validation = validate_store(params, mix=mix)
    if hp.verify_after:  # the store's backend recomputes a few samples per shard: the model at hand, the same vLLM
        # server, or SGLang's two passes over the picked samples (the same servers; with launch, started again in turn)
        if hp.backend == "vllm":
            make = vllm_backend(params, info, config, layers)
        elif hp.backend == "sglang":
            make = sglang_backend(params, info, config, layers)
        else:
            make = lambda: Capture(  # noqa: E731
                plan.model if plan.model is not None else load_extract_model(params), layers, _torch_dtype(hp.dtype),
                hp.final_state)
        result.verification = verify_store(params, config=config, backend=make, positions=hp.verify_positions,
                                           recompute=hp.verify_recompute)
    return result


def merge_index(params: RunParams, *, mix: Mix | None = None, config: Any = None, allow_partial: bool = False) -> Any:
    """The one index of the run's store from every worker's finished shards (`merge.merge_store` with the model's
    layer plan and hidden size, from `config` or the checkpoint's); IncompleteError while samples are missing."""
    config = config if config is not None else load_config(params)
    return merge_store(params, layer_plan(params, config), int(text_config(config).hidden_size), mix=mix,
                       allow_partial=allow_partial)
