"""Stage 06: train a draft per variant on the run's speculators hand-off and measure its acceptance length.

One plan (`plan_value`), shown by notebook 06 and run by `python -m eagle3data value RUN` and
`eagle3data run` (when `value.enabled`): the hand-off, the store's layers, the evaluation prompts
(HumanEval + the held-out split, written to `value/eval_prompts.jsonl` as sent), the training rows
(the hand-off's rows less every held-out conversation, refused when an evaluation prompt leaks in),
the variants. `run_value` then makes the reference continuations (the plain server's greedy ids,
kept in `value/reference.jsonl`), the target's states over them (04's Capture), and per variant:
trains (resumable), measures offline τ and engine τ with 95% intervals over prompts, checks that the
speculative ids equal the greedy ones, and writes `value/<variant>/result.json`. A finished variant
is kept on the next run; `value/summary.json` gathers them. Offline τ is also measured at every
`value.eval.temperatures` (sampling.py; the engine at T = 0 only); with several `value.train.seeds`, exact is
trained once per seed (`value/exact_seed<s>/`) and the summary carries its seed spread, each Δτ judged against
evaluation and seed noise, and τ per doubling of training tokens over `half` and `exact` (spread.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from eagle3data.core.atomic import write_atomic
from eagle3data.core.models import tokenizer_for
from eagle3data.core.params import RunParams
from eagle3data.core.params.run import with_overrides
from eagle3data.core.params.hidden import storage_default_text
from eagle3data.core.peer_logs import PEER_LOG, peers_to_log
from eagle3data.core.profiles import get_profile
from eagle3data.core.progress import Progress
from eagle3data.core.provenance import git_state, package_versions, params_of_run, write_provenance
from eagle3data.core.reader import SampleKey, read_run
from eagle3data.hidden.capture import layer_plan, load_config, load_extract_model
from eagle3data.generate.backends.vllm_server import model_dir
from eagle3data.value.compare import _per_prompt, diff_to, diff_to_exact, storage_decision
from eagle3data.value.engine import request_seed, serve_temperatures
from eagle3data.value.evalset import EvalPrompt, held_out_prompts, humaneval_prompts, leak_problems
from eagle3data.value.offline import EvalSeq, offline_tau, per_position, target_states
from eagle3data.value.online import online_handoff, train_online
from eagle3data.value.plots import save_figures
from eagle3data.value.sampling import along_of, offline_by_temperature, target_head_of, temperature_key
from eagle3data.value.spread import ratio_ci, seed_spreads, size_curve
from eagle3data.value.train import (DRAFT_DIR, TrainConfig, ValueStageError, ValueStopped, check_draft_layers,
                                    layer_ids_of_store, load_draft, train_draft, training_identity)
from eagle3data.value.variants import COMPARED_WITH, GENERATED, VARIANTS, VariantData, variant_data

HANDOFF = Path("export") / "speculators"
# the variants that differ from exact by their number of training rows only: the data-size curve's points
SIZE_POINTS = ("quarter", "half", "exact", "double")


@dataclass
class ValuePlan:
    run_dir: Path
    handoff: Path
    model_dir: Path
    layer_ids: list[int]
    evals: list[EvalPrompt]
    train_rows: list[int]
    train_keys: list[str]
    excluded_rows: int
    variants: list[str]
    held_out: dict[str, Any] = field(default_factory=dict)
    held_convs: frozenset[str] = frozenset()  # the held-out conversations' keys (never trained on, in any variant)

    def table(self) -> Any:
        import pandas as pd

        counts: dict[str, int] = {}
        for e in self.evals:
            counts[e.dataset] = counts.get(e.dataset, 0) + 1
        return pd.DataFrame([{"evaluation set": k, "prompts": v} for k, v in counts.items()]
                            + [{"evaluation set": "(training rows)", "prompts": len(self.train_rows)}])


def plan_value(params: RunParams, *, tokenizer: Any = None) -> ValuePlan:
    """What 06 will train and evaluate on; refuses a missing hand-off, unknown variants and any leak."""

    run_dir = params.run_dir
    handoff = run_dir / HANDOFF
    info_path = handoff / "handoff.json"
    if not info_path.exists():
        raise ValueStageError(f"{info_path}: no speculators hand-off (run 04 and 05 with export.formats including "
                          "speculators first)")
    bad = [v for v in params.value.variants if v not in VARIANTS]
    if bad:
        raise ValueStageError(f"value.variants: unknown variant {bad[0]!r}; known: {', '.join(VARIANTS)}")
    if "online" in params.value.variants:  # refused now, not after the variants before it have trained
        online_handoff(run_dir)
    for v, ref in COMPARED_WITH.items():
        if v in params.value.variants and ref not in params.value.variants:
            raise ValueStageError(f"value.variants: {v} is compared with {ref}; add {ref} to value.variants")
    if "double" in params.value.variants and (nolimit := [d.name for d in params.datasets if d.limit is None]):
        raise ValueStageError(f"datasets: {nolimit[0]} has no limit: variant double doubles each dataset's limit")
    bad = [v for v in params.value.eval.engine_variants or [] if v not in params.value.variants]
    if bad:
        raise ValueStageError(f"value.eval.engine_variants: {bad[0]!r} is not in value.variants "
                              f"{params.value.variants}")
    if exact_seeds(params)[1:] and "exact" not in params.value.variants:
        raise ValueStageError("value.train.seeds: the seeds spread exact's τ; value.variants has no exact")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    keys = [str(k) for k in info.get("keys") or []]
    layer_ids = layer_ids_of_store(run_dir / "hidden")
    ev = params.value.eval
    tok = tokenizer if tokenizer is not None else tokenizer_for(params)
    profile = get_profile(params.profile)
    view = read_run(run_dir, rebuilt=False, verdicts=False)
    records = view.records()
    evals = humaneval_prompts(tok, profile, ev.humaneval) if ev.humaneval else []
    held = held_out_prompts(records, ev.held_out_per_dataset, ev.seed) if ev.held_out_per_dataset else []
    evals += held
    held_convs = {e.key for e in held}
    rows = [i for i, k in enumerate(keys) if k.split("#", 1)[0] not in held_convs]
    if params.value.train.max_train_samples:
        rows = rows[: params.value.train.max_train_samples]
    by_key = {str(SampleKey.of(r)): r for r in records}
    train_keys = [keys[i] for i in rows]
    problems = leak_problems(evals, train_keys, {k: by_key.get(k, {}) for k in train_keys}, str(info_path))
    if problems:
        raise ValueStageError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return ValuePlan(run_dir, handoff, Path(model_dir(params)), layer_ids, evals, rows, train_keys,
                     len(keys) - len(rows), list(params.value.variants),
                     {"ok": True, "by_key": True, "by_text": True, "held_out_conversations": len(held_convs),
                      "excluded_rows": len(keys) - len(rows), "humaneval": sum(e.dataset == "humaneval" for e in evals)},
                     frozenset(held_convs))


# ----------------------------------------------------------------------------------------------- figures


# ----------------------------------------------------------------------------------------------- steps


def stop_requested(run_dir: Path) -> Callable[[], bool]:
    """True once a stop is asked for: the run's STOP file (`eagle3data run`'s first Ctrl-C, `eagle3data stop RUN`)."""
    return lambda: (run_dir / "STOP").exists()


def _eval_rows_path(run_dir: Path) -> Path:
    return run_dir / "value" / "eval_prompts.jsonl"


def _reference_path(run_dir: Path, temperature: float) -> Path:
    name = "reference.jsonl" if not temperature else f"reference_T{temperature_key(temperature)}.jsonl"
    return run_dir / "value" / name


def reference_continuations(params: RunParams, plan: ValuePlan, say: Callable[[str], None],
                            model: Any = None) -> dict[float, list[list[int]]]:
    """The target's own continuation of every evaluation prompt, {T: ids per prompt}: greedy at T = 0 (the
    reference of offline τ at T = 0 and of the lossless check) and sampled at each `eval.temperatures` T > 0
    (`request_seed(eval.seed, T, i)`, the plain tempered softmax: offline τ at T is taken along them, the contexts
    the engine meets serving at T). One plain vLLM server for the temperatures not kept (value/reference*.jsonl,
    reused while prompts, length, temperature and seeds match); without the engine, the HF model's `generate`."""
    ev = params.value.eval
    temps = [0.0] + [float(t) for t in ev.temperatures if t]
    want = {T: [e.row() | {"max_new_tokens": ev.max_new_tokens}
                | ({"temperature": T, "seed": request_seed(ev.seed, T, i)} if T else {})
                for i, e in enumerate(plan.evals)] for T in temps}
    out: dict[float, list[list[int]]] = {}
    for T in temps:
        path = _reference_path(plan.run_dir, T)
        if path.exists():
            rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
            if [{k: r.get(k) for k in w} for r, w in zip(rows, want[T])] == want[T] and len(rows) == len(want[T]):
                say(f"reference continuations at T = {T:g}: {len(rows)} kept from {path}")
                out[T] = [r["output_ids"] for r in rows]
    missing = [T for T in temps if T not in out]
    if not missing:
        return out
    info: dict[str, Any] = {}
    if ev.engine:
        by_t, info = serve_temperatures(params, ev.server, [e.prompt_ids for e in plan.evals], ev.max_new_tokens,
                                        stage="06_plain", concurrency=ev.concurrency, say=say,
                                        stop=stop_requested(plan.run_dir), temperatures=missing, seed=ev.seed)
        got = {T: ([s.ids for s in by_t[T]], [s.seconds for s in by_t[T]]) for T in missing}
    else:
        got = {T: (_hf_continuations(model, plan, ev.max_new_tokens, T, [w.get("seed") for w in want[T]]),
                   [None] * len(plan.evals)) for T in missing}
    for T, (outs, secs) in got.items():
        write_atomic(_reference_path(plan.run_dir, T), "".join(json.dumps(w | {"output_ids": o, "seconds": s}) + "\n"
                                                              for w, o, s in zip(want[T], outs, secs)).encode())
        out[T] = outs
    if info:
        write_atomic(plan.run_dir / "value" / "plain_serving.json", json.dumps(info, indent=1).encode())
    return out


def _hf_continuations(model: Any, plan: ValuePlan, max_new: int, temperature: float,
                      seeds: Sequence[int | None]) -> list[list[int]]:
    """The HF model's continuations: greedy at T = 0, else sampled from the plain tempered softmax (no top-k/top-p),
    the generator seeded per prompt."""
    import torch

    outs = []
    for e, sd in zip(plan.evals, seeds):
        kw: dict[str, Any] = {"do_sample": False}
        if temperature:
            torch.manual_seed(int(sd or 0))
            kw = {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}
        with torch.inference_mode():
            g = model.generate(torch.tensor([e.prompt_ids]), max_new_tokens=max_new, **kw)
        outs.append(g[0, len(e.prompt_ids):].tolist())
    return outs


def _train_config(params: RunParams) -> TrainConfig:
    tp = params.value.train
    return TrainConfig(epochs=tp.epochs, total_seq_len=tp.total_seq_len, lr=tp.lr, optimizer=tp.optimizer,
                       ttt_steps=tp.ttt_steps, loss_fn=tp.loss_fn, num_layers=tp.num_layers, seed=tp.seed,
                       max_steps=tp.max_steps, checkpoint_every=tp.checkpoint_every, threads=tp.threads,
                       muon_ns_dtype=tp.muon_ns_dtype)


def _fingerprint(params: RunParams, plan: ValuePlan, variant: str, vd: VariantData) -> dict[str, Any]:
    """What a finished variant was made from: a change re-runs it. Not `train.seeds` (a seed's own draft carries its
    `train.seed`) nor `eval.temperatures` (a kept variant is measured at a missing temperature offline, untrained)."""
    return {"variant": variant, "train": params.value.train.model_dump(exclude={"seeds"}),
            "eval": params.value.eval.model_dump(exclude={"server", "concurrency", "temperatures"}),
            "rows": len(vd.rows), "data": vd.info.get("fingerprint"), "layer_ids": plan.layer_ids,
            "eval_prompts": len(plan.evals),
            "training": training_identity(vd.handoff, vd.rows, _train_config(params)) if vd.rows else None}


def made_alike(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two fingerprints of the same draft and evaluation: `eval.engine_variants` aside (whether the engine serves
    this variant is its `engine_temperatures`, compared beside: adding the engine to a variant trains nothing again)."""
    def core(f: dict[str, Any]) -> dict[str, Any]:
        return f | {"eval": {k: v for k, v in (f.get("eval") or {}).items() if k != "engine_variants"}}
    return core(a) == core(b)


def exact_seeds(params: RunParams) -> list[int]:
    """The seeds exact is trained with, `train.seed` first (its draft is `value/exact/`, the one every variant is
    compared with; each other seed's in `value/exact_seed<s>/`); the other variants train with `train.seed` only."""
    tp = params.value.train
    return [tp.seed] + [s for s in tp.seeds or [] if s != tp.seed]


def with_seed(params: RunParams, seed: int) -> RunParams:
    v = params.value
    return params.model_copy(update={"value": v.model_copy(update={"train": v.train.model_copy(update={"seed": seed})})})


def _add_temperatures(prev: dict[str, Any], out: Path, seqs: list[EvalSeq], head: Callable[[Any], Any],
                      params: RunParams, say: Callable[[str], None],
                      seqs_at: dict[float, list[EvalSeq]] | None = None) -> dict[str, Any]:
    """A kept variant measured offline at the temperatures it lacks, or took along other continuations than
    `seqs_at` gives (its draft as trained; nothing else re-run)."""
    temps = params.value.eval.temperatures
    have = [{t for t, x in (f.get("offline_by_temperature") or {}).items()
             if x.get("along", "greedy") == along_of(float(t), seqs_at)} for f in prev["per_dataset"].values()]
    if all({temperature_key(t) for t in temps} <= h for h in have):
        return prev
    say(f"{out.name}: offline τ at temperatures {temps}")
    draft = load_draft(out / DRAFT_DIR)
    pp, anchors, per_ds = offline_by_temperature(draft, seqs, head, params.value.eval.num_speculative_tokens, temps,
                                                 params.value.train.seed, at=seqs_at)
    rows = _per_prompt(out.parent, out.name)
    for r, t, a in zip(rows, pp, anchors):
        r["offline_accepted_by_temperature"] = (r.get("offline_accepted_by_temperature") or {}) | t
        r["offline_anchors_by_temperature"] = (r.get("offline_anchors_by_temperature") or {}) | a
    for ds, f in prev["per_dataset"].items():
        f["offline_by_temperature"] = (f.get("offline_by_temperature") or {}) | per_ds[ds]
    write_atomic(out / "per_prompt.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    write_atomic(out / "result.json", json.dumps(prev, indent=1).encode())
    return prev


def _engine_temperatures(params: RunParams, variant: str, folder: str | None = None) -> list[float]:
    """The temperatures the engine serves this variant's draft at: none without the engine, where
    `eval.engine_variants` leaves it out, or for exact's other seeds when `engine_variants` is given (their spread is
    offline τ's: the engine's decoding is most of a variant's time); else T = 0 (the lossless check) and every
    `eval.temperatures`."""
    ev = params.value.eval
    if not ev.engine or (ev.engine_variants is not None and (variant not in ev.engine_variants
                                                             or (folder or variant) != variant)):
        return []
    return [0.0] + [float(t) for t in ev.temperatures if t]


def _check_leaks(params: RunParams, plan: ValuePlan, vd: VariantData) -> None:
    """A regenerated variant's training rows hold no evaluation prompt (by key or text: evalset.leak_problems)."""
    keys = [str(k) for k in json.loads((vd.handoff / "handoff.json").read_text(encoding="utf-8"))["keys"]]
    train = [keys[i] for i in vd.rows]
    by_key = {str(SampleKey.of(r)): r for r in read_run(vd.handoff.parents[1], rebuilt=False, verdicts=False).records()}
    problems = leak_problems(plan.evals, train, {k: by_key.get(k, {}) for k in train}, str(vd.handoff / "handoff.json"))
    if problems:
        raise ValueStageError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def run_variant(params: RunParams, plan: ValuePlan, variant: str, seqs: list[EvalSeq],
                say: Callable[[str], None], head: Callable[[Any], Any], folder: str | None = None,
                seqs_at: dict[float, list[EvalSeq]] | None = None) -> dict[str, Any]:
    """Build (or keep) one variant's data, train (or resume) its draft, then measure it offline (at every
    `eval.temperatures`, with the target's `head`) and through the engine. `folder`: `value/<folder>/` (default the
    variant's name; exact's other seeds); `seqs_at`: the evaluation prompts with the target's continuations sampled at
    each T > 0 (offline τ at T is taken along them). The peer libraries' log lines go to `value/<folder>/peers.log`."""
    out = plan.run_dir / "value" / (folder or variant)
    out.mkdir(parents=True, exist_ok=True)
    with peers_to_log(out / PEER_LOG):
        return _run_variant(params, plan, variant, seqs, say, head, folder, seqs_at)


def _run_variant(params: RunParams, plan: ValuePlan, variant: str, seqs: list[EvalSeq],
                 say: Callable[[str], None], head: Callable[[Any], Any], folder: str | None = None,
                 seqs_at: dict[float, list[EvalSeq]] | None = None) -> dict[str, Any]:
    tp, ev = params.value.train, params.value.eval
    folder = folder or variant
    out = plan.run_dir / "value" / folder
    done = out / "result.json"
    vd = variant_data(params, variant, plan.handoff, plan.train_rows, plan.train_keys, say,
                      stop=stop_requested(plan.run_dir), held=plan.held_convs)
    if variant in GENERATED:  # prompts of its own: none may be an evaluation prompt
        _check_leaks(params, plan, vd)
    fp = _fingerprint(params, plan, variant, vd)
    engine_temps = _engine_temperatures(params, variant, folder)
    if done.exists():
        prev = json.loads(done.read_text(encoding="utf-8"))
        if made_alike(prev.get("fingerprint") or {}, fp) and prev.get("engine_temperatures",
                                                                    [0.0] if ev.engine else []) == engine_temps:
            say(f"{folder}: finished earlier, kept ({done})")
            prev = _add_temperatures(prev, out, seqs, head, params, say, seqs_at)
            return prev | ({"data": vd.info} if vd.info else {})  # what is known of its data now
    if not vd.rows:
        raise ValueStageError(f"{vd.handoff / 'handoff.json'}: variant {variant} has no training rows")
    cfg = _train_config(params)
    rows = vd.rows
    say(f"{variant}: training on {len(rows):,} rows of {vd.handoff}")
    online = None
    if variant == "online":  # the states generated as it trains, by a states server started for it
        tr, online = train_online(params, vd.handoff, plan.model_dir, plan.layer_ids, out, cfg, rows,
                                  say=lambda s: say(f"{variant}: {s}"), stop=stop_requested(plan.run_dir))
    else:
        tr = train_draft(vd.handoff, plan.model_dir, plan.layer_ids, out, cfg, rows,
                         say=lambda s: say(f"{variant}: {s}"), stop=stop_requested(plan.run_dir))
    check_draft_layers(tr.draft_dir, plan.layer_ids)
    K = ev.num_speculative_tokens
    draft = load_draft(tr.draft_dir)
    d2t = draft.d2t
    t0 = time.monotonic()
    offline = [offline_tau(draft, s, K, d2t) for s in seqs]
    offline_s = time.monotonic() - t0
    by_t = offline_by_temperature(draft, seqs, head, K, ev.temperatures, tp.seed, greedy=offline, at=seqs_at)
    temps_s = time.monotonic() - t0 - offline_s
    del draft
    engine = bool(engine_temps)
    by_temp, info = (serve_temperatures(params, ev.server, [e.prompt_ids for e in plan.evals], ev.max_new_tokens,
                                        stage=f"06_{folder}", draft_dir=tr.draft_dir, k=K, concurrency=ev.concurrency,
                                        say=say, stop=stop_requested(plan.run_dir), temperatures=engine_temps,
                                        seed=ev.seed)
                     if engine else ({0.0: [None] * len(seqs)}, {}))
    served = by_temp[0.0]
    per_prompt, per_ds = [], {}
    lossless_all = True
    for i, (e, s, o, sv, bt, ba) in enumerate(zip(plan.evals, seqs, offline, served, by_t[0], by_t[1])):
        ref = s.input_ids[s.prompt_len:]
        lossless = None if sv is None else sv.ids == ref  # T = 0 only: at T > 0 lossless in distribution
        lossless_all &= lossless is not False
        per_prompt.append({"dataset": e.dataset, "sample_id": e.sample_id, "anchors": o.anchors,
                           "offline_accepted": sum(o.accepted), "tau_offline": o.tau,
                           "offline_accepted_by_temperature": bt, "offline_anchors_by_temperature": ba,
                           "engine_steps": None if sv is None else sv.steps,
                           "engine_accepted": None if sv is None else sv.accepted,
                           "tau_engine": None if sv is None else sv.tau, "lossless": lossless,
                           "per_step_accepted": None if sv is None else sv.per_step,
                           "engine_by_temperature": {temperature_key(T): {"steps": r[i].steps, "accepted": r[i].accepted}
                                                     for T, r in by_temp.items() if r[i] is not None}})
    for ds in dict.fromkeys(e.dataset for e in plan.evals):
        idx = [i for i, e in enumerate(plan.evals) if e.dataset == ds]
        pp = [per_prompt[i] for i in idx]
        t_off, ci_off = ratio_ci([p["offline_accepted"] for p in pp], [p["anchors"] for p in pp], tp.seed)
        t_eng, ci_eng = (ratio_ci([p["engine_accepted"] for p in pp], [p["engine_steps"] for p in pp], tp.seed)
                         if engine else (None, None))
        steps = [a for p in pp for a in (p["per_step_accepted"] or [])]
        per_ds[ds] = {"prompts": len(pp), "tau_offline": t_off, "tau_offline_ci95": ci_off, "tau_engine": t_eng,
                      "tau_engine_ci95": ci_eng,
                      "per_position": per_position([offline[i] for i in idx], K),
                      "per_position_engine": ([round(sum(a >= k for a in steps) / len(steps), 4) for k in range(1, K + 1)]
                                              if steps else None),
                      "lossless": None if not engine else all(p["lossless"] for p in pp),
                      "not_lossless": [p["sample_id"] for p in pp if p["lossless"] is False],
                      "offline_by_temperature": by_t[2].get(ds),
                      "engine_by_temperature": {t: dict(zip(("tau", "tau_ci95"), ratio_ci(
                          [p["engine_by_temperature"][t]["accepted"] for p in pp],
                          [p["engine_by_temperature"][t]["steps"] for p in pp], tp.seed)))
                          for t in map(temperature_key, engine_temps)}}
    pooled = {k: info.get("counters", {}).get(f"spec_decode_num_{k}") for k in ("drafts", "accepted_tokens")}
    check = None
    if engine:  # per temperature: the per-request figures summed equal that pass's counters
        check = {"per_request_steps": sum(p["engine_steps"] or 0 for p in per_prompt),
                 "per_request_accepted": sum(p["engine_accepted"] or 0 for p in per_prompt),
                 "counters_drafts": pooled["drafts"], "counters_accepted": pooled["accepted_tokens"]}
        check["agree"] = (check["per_request_steps"] == check["counters_drafts"]
                          and check["per_request_accepted"] == check["counters_accepted"])
        for t, bt_info in (info.get("by_temperature") or {}).items():
            c = bt_info["counters"]
            check.setdefault("by_temperature", {})[t] = ok = (
                sum(p["engine_by_temperature"][t]["steps"] or 0 for p in per_prompt) == c.get("spec_decode_num_drafts")
                and sum(p["engine_by_temperature"][t]["accepted"] or 0 for p in per_prompt)
                == c.get("spec_decode_num_accepted_tokens"))
            check["agree"] &= ok
    result = {"variant": variant, "folder": folder, "seed": tp.seed, "about": VARIANTS[variant],
              "draft_dir": str(tr.draft_dir),
              "train_tokens": tr.train_tokens, "train_samples": len(rows), "steps": tr.steps, "seconds": tr.seconds,
              "tokens_per_s": round(tr.train_tokens / tr.seconds, 1) if tr.seconds else None,
              "final_loss": tr.log[-1]["loss"] if tr.log else None, "offline_s": round(offline_s, 1),
              "offline_temperatures_s": round(temps_s, 1),
              "engine": info, "engine_temperatures": engine_temps, "counters_check": check,
              "lossless": lossless_all if engine else None,
              "per_dataset": per_ds, "data": vd.info, "fingerprint": fp}
    if "verify_hidden" in vd.info:
        result["verify_hidden"] = vd.info["verify_hidden"]
    if online is not None:
        result["online"] = online
    write_atomic(out / "per_prompt.jsonl", "".join(json.dumps(p) + "\n" for p in per_prompt).encode())
    write_atomic(done, json.dumps(result, indent=1).encode())
    return result


def run_value(params: RunParams, *, say: Callable[[str], None] | None = None,
              plan: ValuePlan | None = None) -> dict[str, Any]:
    """The whole stage: plan, references, states, every variant; writes value/summary.json and returns it.

    Each step's line goes to `progress.json` (what `eagle3data run` and `status` show) and to `say`; without
    `say`, to the one live line of a notebook or terminal (`core.progress.Progress`)."""
    plan = plan or plan_value(params)
    prog = Progress(say is None, run_dir=plan.run_dir, stage="06_value")
    shout = say

    def say(line: str) -> None:  # noqa: F811 - every step's line, to both
        prog.update(line)
        if shout is not None:
            shout(line)

    vdir = plan.run_dir / "value"
    vdir.mkdir(parents=True, exist_ok=True)
    write_atomic(_eval_rows_path(plan.run_dir), "".join(json.dumps(e.row()) + "\n" for e in plan.evals).encode())
    t0 = time.monotonic()
    model = None if params.value.eval.engine else load_extract_model(params)  # without an engine: loaded once
    refs = reference_continuations(params, plan, say, model)
    at = {T: [EvalSeq(e.dataset, e.sample_id, len(e.prompt_ids), e.prompt_ids + r) for e, r in zip(plan.evals, outs)]
          for T, outs in refs.items()}
    seqs = at.pop(0.0)
    model = model if model is not None else load_extract_model(params)
    layers = layer_plan(params, load_config(params))
    if list(layers.hf_indices) != plan.layer_ids:
        raise ValueStageError(f"{plan.run_dir / 'hidden' / 'index.json'}: the store's layers {plan.layer_ids} are not "
                          f"the profile's plan {list(layers.hf_indices)} for this model")
    say(f"target states over {len(seqs)} evaluation sequences" + (f", and their continuations sampled at T = "
                                                                  f"{', '.join(f'{T:g}' for T in at)}" if at else ""))
    with peers_to_log(vdir / PEER_LOG):
        target_states(model, layers, seqs + [s for v in at.values() for s in v])
    head = target_head_of(model)  # the final norm and head only: offline τ at T > 0 needs the target's distribution
    del model
    results = [run_variant(params, plan, v, seqs, say, head, seqs_at=at) for v in plan.variants]
    seeds = exact_seeds(params) if "exact" in plan.variants else []
    seed_runs = [run_variant(with_seed(params, s), plan, "exact", seqs, say, head, folder=f"exact_seed{s}", seqs_at=at)
                 for s in seeds[1:]]
    exact_folders = ["exact"] + [f"exact_seed{s}" for s in seeds[1:]]
    ev = params.value.eval
    tp_seed = params.value.train.seed
    temps = sorted({0.0, *map(float, ev.temperatures)})  # the differences at every temperature measured
    spread = (seed_spreads([r for r in results if r["variant"] == "exact"] + seed_runs,
                           [_per_prompt(vdir, f) for f in exact_folders], seeds, [temperature_key(t) for t in temps])
              if seed_runs else None)
    spread_at = (spread or {}).get("pooled_by_temperature")
    counts: dict[str, int] = {}
    for e in plan.evals:
        counts[e.dataset] = counts.get(e.dataset, 0) + 1
    summary = {"target": str(plan.model_dir), "run": str(plan.run_dir), "handoff": str(plan.handoff),
               "layer_ids": plan.layer_ids,
               "eval": {"max_new_tokens": ev.max_new_tokens, "num_speculative_tokens": ev.num_speculative_tokens,
                        "dtype": ev.server.dtype or params.model.dtype, "prompts": counts, "engine": ev.engine,
                        "temperatures": ev.temperatures},
               "held_out": plan.held_out,
               "variants": [{k: r.get(k) for k in ("variant", "about", "draft_dir", "train_tokens", "train_samples",
                                                   "steps", "seconds", "tokens_per_s", "final_loss", "lossless",
                                                   "per_dataset", "counters_check")}
                            | ({"verify_hidden": r["verify_hidden"]} if "verify_hidden" in r else {})
                            | ({"online": r["online"]} if "online" in r else {})
                            | ({"data": {k: r["data"].get(k) for k in ("records", "api_records", "proof_levels",
                                                                        "ids_differ_from_exact", "ids_differ_from_sampled",
                                                                        "generate", "audit", "mix", "peer",
                                                                        "extract", "seconds") if k in r["data"]}}
                               if r.get("data") else {})
                            | ({"engine_temperatures": r.get("engine_temperatures")})
                            | ({"diff_to_exact": diff_to_exact(vdir, r["variant"], tp_seed, exact_folders,
                                                               (spread or {}).get("pooled"), temps, spread_at)}
                               if r["variant"] != "exact" and "exact" in plan.variants else {})
                            | ({"diff_to": diff_to(vdir, r["variant"], [COMPARED_WITH[r["variant"]]], tp_seed,
                                                   (spread or {}).get("pooled"), temps, spread_at)}
                               if r["variant"] in COMPARED_WITH else {})
                            for r in results],
               "seconds": round(time.monotonic() - t0, 1), "git": git_state(), "versions": package_versions()}
    if spread:
        summary["seed_spread"] = spread
    by = {r["variant"]: r for r in results}
    size = [(v, by[v]["train_tokens"], [_per_prompt(vdir, f) for f in (exact_folders if v == "exact" else [v])])
            for v in SIZE_POINTS if v in by]
    if len(size) > 1:  # τ per doubling of training tokens (quarter, half, exact: the same rows, in part; double)
        summary["size_slope"] = size_curve(size, tp_seed, (spread or {}).get("pooled"))
    if "exact" in plan.variants:
        summary["storage_decision"] = storage_decision(summary)
    write_atomic(vdir / "summary.json", json.dumps(summary, indent=1).encode())
    say(f"06 done in {summary['seconds']:.0f} s: " + "; ".join(
        f"{v['variant']} {ds} τ {f['tau_engine'] if f['tau_engine'] is not None else f['tau_offline']}"
        for v in summary["variants"] for ds, f in v["per_dataset"].items()))
    write_provenance(plan.run_dir, "06_value", params)
    save_figures(plan.run_dir, summary)
    bad = [(r["variant"], ds, v["not_lossless"]) for r in results for ds, v in r["per_dataset"].items()
           if v.get("not_lossless")]
    if bad:
        v, ds, ids = bad[0]
        raise ValueStageError(f"{vdir / v / 'per_prompt.jsonl'}: speculative ids differ from greedy ids for {len(ids)} "
                          f"{ds} prompt(s) (first {ids[0]}): speculation must be lossless; a fault in the draft, its "
                          "config or its vocabulary map")
    return summary


def value_cli(run: str, variants: list[str] | None = None, overrides: dict[str, Any] | None = None) -> int:
    """`python -m eagle3data value RUN`: the params recorded in the run (with `-p value.*` overrides), 06 on them;
    exit 3 when stopped (resumable)."""
    params = params_of_run(Path(run))
    if overrides:
        params = with_overrides(params, overrides, run, only="value")
    (params.run_dir / "STOP").unlink(missing_ok=True)  # left by an earlier run: a STOP written from now on is this one's
    if variants:
        params = params.model_copy(update={"value": params.value.model_copy(update={"variants": variants})})
    try:
        summary = run_value(params, say=lambda s: print(s, flush=True))
    except ValueStopped as e:
        print(f"stopped: {e}. Resume: python -m eagle3data value {run}", flush=True)
        return 3
    print(summary_lines(summary))
    return 0


def summary_lines(summary: dict[str, Any]) -> str:
    """The table as text: each variant's τ per evaluation dataset, its difference to exact, the storage decision."""
    lines = []
    w = max(len(v["variant"]) for v in summary["variants"])
    for v in summary["variants"]:
        for ds, f in v["per_dataset"].items():
            lines.append(f"{v['variant']:>{w}} {ds:<20} τ engine {f['tau_engine']} {f['tau_engine_ci95']}  "
                         f"offline {f['tau_offline']} {f['tau_offline_ci95']}  per position {f['per_position']}  "
                         f"lossless {f['lossless']}")
            by = {t: x for t, x in (f.get("offline_by_temperature") or {}).items() if float(t)}
            if by:
                lines.append(f"{'':>{w}} {'':<20} offline τ at " + "; ".join(
                    f"T={float(t):g} {x['tau']} {x['tau_ci95']}" for t, x in by.items()))
        d = v.get("diff_to_exact")
        if d:
            kind = "engine" if d.get("tau_engine") is not None else "offline"
            more = ("significant" if d["significant"] else
                    f"not significant at {d['eval_tokens']:,} eval tokens; ~{d['eval_tokens_to_resolve']:,} would resolve it"
                    if d.get("eval_tokens_to_resolve") else "not significant")
            lines.append(f"{'':>{w}} vs exact: Δτ {kind} {d[f'tau_{kind}']:+} {d[f'tau_{kind}_ci95']} ({more})")
            j = d.get("judged") or {}
            if "training seeds" in (j.get("judged_against") or []):
                lines.append(f"{'':>{w}} judged against evaluation and {d['exact_seeds']} seeds: {j['ci95']} "
                             f"({'significant' if j['significant'] else 'not significant'})")
        on = v.get("online")
        if on:
            st = on["store_check"]
            lines.append(f"{'':>{w}} online: {on['rows_generated']:,} rows' states generated ({on['requests']:,} "
                         f"requests), echoed ids equal {on['echoed_ids_equal']:,}, failed {on['failed_requests']}; vs "
                         f"04's store {st['rows']:,} rows, {st['failed']} beyond tolerance")
        vh = v.get("verify_hidden")
        if vh and "exit" in vh:
            lines.append(f"{'':>{w}} verify-hidden: exit {vh['exit']}, {vh.get('failed_samples')} of "
                         f"{vh.get('samples')} samples failed")
    sp = summary.get("seed_spread")
    if sp:
        lines += [f"exact over seeds {sp['seeds']}: {ds} " + "; ".join(
                  f"{k} τ mean {x['mean']} sd {x['sd']} ({x['min']}–{x['max']})" for k, x in kinds.items() if x["seeds"])
                  for ds, kinds in list(sp["per_dataset"].items()) + [("(pooled)", sp["pooled"])]]
    sd = summary.get("storage_decision")
    if sd:
        lines.append(f"storage default: {storage_default_text(sd['default'])} (rule: {sd['rule']})")
        if "params_default" in sd:
            follow = sd["params_follow"]
            lines.append(f"params default (hidden.storage not given): {storage_default_text(sd['params_default'])}"
                         + (" — no 8-bit variant ran: not checked" if follow is None
                            else "" if follow else " — differs from the measured decision"))
    return "\n".join(lines)
