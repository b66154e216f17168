"""06's variants: the same draft trained on degraded copies of the run's data, each built by the project's own stages.

`exact` is the run's hand-off as it is; `half` its first half of the training rows. Every other variant is a
run folder of its own, `value/<variant>/run/`, holding the training conversations' records (never the held-out
ones) and made into a speculators hand-off by 02, 04 and 05 with params, as a user would make it:

- `retokenized`: the exact records as an API returns them (text, billed counts; no ids) -> 02 rebuilds the ids
  from the text (its one split and checks) -> 04 computes the states for those ids -> 05;
- `dataset_replies`: the dataset's own replies (its prompt file's `meta.reference_reply`, read as 01 reads the
  file) in place of the target's outputs, as text
  records -> 02 -> 04 -> 05: what a user trains on who skips 01 (02's proof is `text`: no billed counts, so 04's
  `min_proof_level` is `text` for it);
- `shifted`: 04 on the exact records with the engine's states handed to the writer one position early (row t holds
  row t+1's states: the bug class verify-hidden's `shifted_one_position` plant stands for); verify-hidden's own
  command then judges the store (its verdict and exit status are in the variant's result) and 05 exports it anyway
  (`export.allow_unverified`), as a user who ignored the check would;
- `int8`: 04 with `hidden.storage: int8` (its default scale, channel_rms; layout shards, since speculators reads no
  int8) -> 05 converts for speculators;
- `fp8`: 04 with `hidden.storage: fp8_e4m3`, `storage_scale: token`, layout speculators (hs-connectors' FP8 files,
  read through FP8Transfer);
- `online`: 05's `export/speculators_online/` as it is (exact's ids, no states): `value.online` trains on it with the
  states generated during training by a vLLM server.

A built variant is kept (`value/<variant>/run/built.json`, with its params' fingerprint); a stopped build resumes
through the stages' own resume (04 keeps what it stored).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
import torch

import eagle3data.hidden.extract as ex
from eagle3data.core.atomic import write_atomic
from eagle3data.core.models import tokenizer_for
from eagle3data.core.params import RunParams
from eagle3data.core.profiles import get_profile
from eagle3data.core.reader import SampleKey, read_run
from eagle3data.export.run import run_export
from eagle3data.hidden.extract import plan_extract, run_extract
from eagle3data.hidden.verify.checks import NOT_SAMPLED
from eagle3data.prompts.load import load_datasets
from eagle3data.rebuild.run import run_reconstruct, turns_from_exact
from eagle3data.value.online import handoff_fingerprint, online_handoff
from eagle3data.value.train import ValueStageError, ValueStopped

VARIANTS = {
    "exact": "the run's hand-off as it is (exact ids, verified bf16 states): the reference",
    "half": "the exact hand-off, the first half of its training rows (how far from saturation)",
    "retokenized": "the same outputs as an API returns them (text), ids rebuilt by 02, states by 04 for those ids",
    "dataset_replies": "the dataset's own replies (meta.reference_reply) in place of the target's outputs (02, 04)",
    "shifted": "04's states handed to the writer one position early (the engine bug class); verify-hidden's verdict",
    "int8": "04 stored in int8 (channel_rms scales, shards), 05 converts for speculators",
    "fp8": "04 stored in fp8_e4m3 with per-token scales (speculators' FP8 files)",
    "online": "05's online hand-off (ids, no states): states generated while training by a vLLM server, through "
              "speculators' online dataset and hs-connectors' file backend",
}
BUILT = "built.json"


@dataclass
class VariantData:
    """What one variant trains on: a speculators hand-off and its rows, and how it was made."""

    handoff: Path
    rows: list[int]
    info: dict[str, Any] = field(default_factory=dict)


def _conv(key: str) -> str:
    return key.split("#", 1)[0]


def variant_params(params: RunParams, variant: str) -> RunParams:
    """The params a user would run for this variant's data: the run's, in `value/<variant>/run/`, one hand-off."""
    hidden: dict[str, Any] = {"dataset_caps": {}, "dataset_weights": {}}  # the folder holds the training rows only
    export: dict[str, Any] = {"formats": ["speculators"]}
    if variant == "dataset_replies":
        hidden["min_proof_level"] = "text"  # replies nobody billed: 02 proves the text, no count
    elif variant == "shifted":
        hidden["verify_after"] = False  # verify-hidden's own command judges it below
        export["allow_unverified"] = True
    elif variant == "int8":
        hidden |= {"storage": "int8", "storage_scale": "channel_rms", "layout": "shards"}
    elif variant == "fp8":
        hidden |= {"storage": "fp8_e4m3", "storage_scale": "token", "layout": "speculators"}
    data = params.model_dump(mode="json")
    data["output_root"] = str(params.run_dir / "value" / variant)
    data["run_name"] = "run"
    data["hidden"] |= hidden
    data["hidden"]["out_dir"] = None
    data["export"] |= export
    data["value"]["enabled"] = False
    return RunParams.model_validate(data)


def _api_records(recs: list[dict[str, Any]], texts: list[Any], provider: str) -> list[dict[str, Any]]:
    """Records as an API run writes them: text fields, no ids (02 rebuilds them)."""
    out = []
    for r, t in zip(recs, texts):
        a = {k: v for k, v in r.items() if k not in ("prompt_ids", "output_ids", "ids_exact", "logprobs")}
        a |= {"source": "api", "provider": provider, "reasoning": t["reasoning"], "content": t["content"],
              "tool_calls": t["tool_calls"], "finish_reason": t["finish_reason"], "usage": t["usage"]}
        out.append(a)
    return out


def variant_records(params: RunParams, variant: str, train_keys: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The training conversations' records of the run, as this variant's run folder holds them (per dataset)."""
    keep = {_conv(k) for k in train_keys}
    view = read_run(params.run_dir, [d.name for d in params.datasets], rebuilt=False, verdicts=False)
    out: dict[str, list[dict[str, Any]]] = {}
    tok = profile = replies = None
    for name, lines in view.datasets.items():
        recs = [r for r in lines.records() if _conv(str(SampleKey.of(r))) in keep]
        if variant == "retokenized":
            exact = [r for r in recs if r.get("output_ids") is not None]
            tok, profile = tok or tokenizer_for(params), profile or get_profile(params.profile)
            turns = turns_from_exact(exact, tok, profile)  # 02's one split of output ids into API text
            recs = _api_records(exact, [{"reasoning": t.reasoning, "content": t.content, "tool_calls": t.tool_calls,
                                         "finish_reason": r["finish_reason"], "usage": r.get("usage")}
                                        for r, t in zip(exact, turns)], "retokenized")
        elif variant == "dataset_replies":
            if replies is None:
                replies = _dataset_replies(params)
            got = replies.get(name, {})
            with_reply = [r for r in recs if str(r["sample_id"]) in got and r.get("turn") is None]
            if recs and not with_reply:
                src = next((d.path for d in params.datasets if d.name == name), name)
                raise ValueStageError(f"{src}: no prompt of dataset {name} has meta.reference_reply (the dataset's own "
                                      "reply): variant dataset_replies needs a dataset whose rows end with an "
                                      "assistant reply")
            recs = [r | {"sampling": None} for r in  # the target sampled none of it
                    _api_records(with_reply, [{"reasoning": None, "content": got[str(r["sample_id"])][0],
                                               "tool_calls": got[str(r["sample_id"])][1],
                                               "finish_reason": "stop", "usage": None} for r in with_reply],
                                 NOT_SAMPLED)]
        out[name] = recs
    return out


def _dataset_replies(params: RunParams) -> dict[str, dict[str, tuple[str, Any]]]:
    """Each dataset's own replies, from its prompt file as 01 loads it (`meta.reference_reply`, kept when a row ends
    with an assistant turn): dataset -> sample_id -> (reply, its tool calls)."""
    return {name: {str(p.sample_id): (p.meta["reference_reply"], p.meta.get("reference_tool_calls"))
                   for p in ps.prompts if isinstance(p.meta.get("reference_reply"), str)}
            for name, ps in load_datasets(params).items()}


@contextmanager
def _states_one_early() -> Iterator[None]:
    """04's writers get each sample's states one position early (row t holds row t+1's): an engine's off-by-one."""
    real = ex.open_writer

    def shifted_writer(*a: Any, **k: Any) -> Any:
        w = real(*a, **k)
        add = w.add
        w.add = lambda s, pos, states: add(s, pos, torch.roll(states, -1, dims=0).contiguous())
        return w

    ex.open_writer = shifted_writer
    try:
        yield
    finally:
        ex.open_writer = real


def _fingerprint(vp: RunParams, train_keys: list[str]) -> str:
    # what makes the data: the params but where it goes and 06's own section (the variants asked for, their order)
    blob = orjson.dumps({"params": vp.model_dump(mode="json", exclude={"output_root", "run_name", "value"}),
                         "keys": sorted(train_keys)}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(blob).hexdigest()[:16]


def build_variant(params: RunParams, variant: str, train_keys: list[str], say: Callable[[str], None],
                  stop: Callable[[], bool] | None = None) -> VariantData:
    """Make this variant's hand-off with 02/04/05 in `value/<variant>/run/` (kept when built with the same params);
    `stop()` is asked between the stages (a stopped build resumes through them)."""
    vp = variant_params(params, variant)
    vrun = vp.run_dir
    handoff = vrun / "export" / "speculators"
    fp = _fingerprint(vp, train_keys)
    built = vrun / BUILT
    if built.exists() and (handoff / "handoff.json").exists():
        info = json.loads(built.read_text(encoding="utf-8"))
        if info.get("fingerprint") == fp:
            say(f"{variant}: data built earlier, kept ({handoff})")
            if variant == "retokenized" and "ids_differ_from_exact" not in info:
                info["ids_differ_from_exact"] = ids_differ(params.run_dir / "export" / "speculators", handoff)
            return VariantData(handoff, _rows_of(handoff, train_keys), info)
    t0 = time.monotonic()
    (vrun / "records").mkdir(parents=True, exist_ok=True)
    recs = variant_records(params, variant, train_keys)
    for name, rs in recs.items():
        write_atomic(vrun / "records" / f"{name}.jsonl", b"".join(orjson.dumps(r) + b"\n" for r in rs))
    info: dict[str, Any] = {"variant": variant, "fingerprint": fp, "records": {n: len(r) for n, r in recs.items()}}
    def check_stop(before: str) -> None:
        if stop is not None and stop():
            raise ValueStopped(f"{variant}: stopped before {before} (what the stages wrote is kept)")

    if variant in ("retokenized", "dataset_replies"):
        check_stop("02")
        say(f"{variant}: 02 rebuilds ids from {sum(info['records'].values()):,} records' text")
        rr = run_reconstruct(vp, progress=False)
        info["api_records"] = rr.summary.get("api_records")
        info["proof_levels"] = (rr.summary.get("overall") or {}).get("proof_levels")
    check_stop("04")
    say(f"{variant}: 04 computes the states ({vp.hidden.backend}, storage {vp.hidden.storage}, layout {vp.hidden.layout})")
    if variant == "shifted":
        with _states_one_early():
            res = run_extract(vp, progress=False, plan=plan_extract(vp, load_model=vp.hidden.backend == "hf"))
    else:
        res = run_extract(vp, progress=False, plan=plan_extract(vp, load_model=vp.hidden.backend == "hf"))
    if not res.merged:
        raise ValueStageError(f"{vrun / 'hidden'}: 04 for variant {variant} did not finish "
                              f"({res.stats.get('failed') or 0} failed, stopped early: {res.stats.get('stopped_early')})")
    info["extract"] = {k: res.stats.get(k) for k in ("extracted", "tokens", "seconds", "tokens_per_s")}
    info["mix"] = {"samples": len(res.index), "dropped": res.plan.mix.manifest.get("dropped_counts")}
    if res.verification is not None:
        info["verify_hidden"] = {"ok": bool(res.verification.ok), "by": "04's own verify pass"}
    if variant == "shifted":  # the user's check, as they would run it: its verdict and exit status
        say(f"{variant}: verify-hidden {vrun}")
        p = subprocess.run([sys.executable, "-m", "eagle3data", "verify-hidden", str(vrun)], capture_output=True,
                           text=True)
        summ = vrun / "hidden" / "verify_summary.json"
        s = json.loads(summ.read_text(encoding="utf-8")) if summ.exists() else {}
        info["verify_hidden"] = {"ok": p.returncode == 0, "failed_samples": s.get("failed_samples"),
                                 "samples": s.get("samples"), "exit": p.returncode,
                                 "line": (p.stdout.strip().splitlines() or [p.stderr.strip()[-300:]])[0]}
    check_stop("05")
    say(f"{variant}: 05 writes the speculators hand-off")
    run_export(vp)
    if variant == "retokenized":  # 0: the same ids as exact's, so its Δτ is the noise of a second 04 and training
        info["ids_differ_from_exact"] = ids_differ(params.run_dir / "export" / "speculators", handoff)
    info["seconds"] = round(time.monotonic() - t0, 1)
    write_atomic(built, json.dumps(info, indent=1).encode())
    return VariantData(handoff, _rows_of(handoff, train_keys), info)


def ids_differ(exact: Path, other: Path) -> dict[str, int]:
    """How many of `other`'s hand-off rows hold ids other than exact's row of the same key (rows, differ)."""
    from datasets import load_from_disk

    def rows(h: Path) -> dict[str, list[int]]:
        keys = json.loads((h / "handoff.json").read_text(encoding="utf-8"))["keys"]
        ds = load_from_disk(str(h))
        return {str(k): list(ds[i]["input_ids"]) for i, k in enumerate(keys)}

    a, b = rows(exact), rows(other)
    return {"rows": len(b), "differ": sum(1 for k, ids in b.items() if a.get(k) != ids)}


def _rows_of(handoff: Path, train_keys: list[str]) -> list[int]:
    """The variant's rows of `train_keys`, in train_keys' order (exact's): the packing sampler's batches follow the
    order of the rows, so a variant stored in another order would train on other batches, and the paired
    difference would measure the order with the data (two drafts on the same ids and states, one in 05's
    order of another run, differed by 0.011 in τ)."""
    keys = [str(k) for k in json.loads((handoff / "handoff.json").read_text(encoding="utf-8")).get("keys") or []]
    at = {k: i for i, k in enumerate(keys)}
    return [at[k] for k in train_keys if k in at]


def variant_data(params: RunParams, variant: str, handoff: Path, train_rows: list[int], train_keys: list[str],
                 say: Callable[[str], None], stop: Callable[[], bool] | None = None) -> VariantData:
    """The hand-off and rows this variant trains on."""
    if variant == "exact":
        return VariantData(handoff, list(train_rows))
    if variant == "half":
        return VariantData(handoff, list(train_rows[: max(1, len(train_rows) // 2)]))
    if variant == "online":  # 05's own folder, in exact's row order; the states come during training (value.online)
        online = online_handoff(params.run_dir)
        return VariantData(online, _rows_of(online, train_keys), {"fingerprint": handoff_fingerprint(online)})
    return build_variant(params, variant, train_keys, say, stop)
