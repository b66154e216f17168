"""06's variants: the same draft trained on degraded copies of the run's data, each built by the project's own stages.

`exact` is the run's hand-off as it is; `half` its first half of the training rows. Every other variant is a
run folder of its own, `value/<variant>/run/`, holding the training conversations' records (never the held-out
ones) and made into a speculators hand-off by 02, 04 and 05 with params, as a user would make it:

- `retokenized`: the exact records as an API returns them (text, billed counts; no ids) -> 02 rebuilds the ids
  from the text (its one split and checks) -> 04 computes the states for those ids (every rebuilt record: its
  `min_proof_level` is `text`, as a re-tokenizing user keeps them all) -> 05;
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
  states generated during training by a vLLM server;
- `text_rule`, `template_other`: exact's training rows as a peer's text path makes them from the conversation text
  (TorchSpec's and Model-Optimizer's rule; SpecForge's `data.train_data_path` with its `qwen` template), written
  where 02 writes rebuilt ids (value/peer_variants.py: proof `text`, 04's `min_proof_level` `text`) -> 04 -> 05.

Variants whose data the target generates again, by 01 in `value/<variant>/gen_<hash>/` (a run folder per
sampling settings: 01 resumes there), the training conversations' records then going through 03 -> 04 -> 05 in `value/<variant>/run/`:

- `sampled`: the run's prompts regenerated at `value.sampled_temperature` (1.0, seeded by the run's
  `generate.sampling.seed`: as the Kimi params regenerate);
- `sampled_retokenized`: sampled's records (those its 04 mixed) as an API returns them (text) -> 02 -> 04 -> 05:
  re-tokenization where the target's output is sampled, and takes splits its tokenizer would not (04's
  `min_proof_level` `text`, as for `retokenized`);
- `double`: each dataset's `limit` doubled (the run's prompts, the first `limit` of the seeded order, and as many
  new ones), greedy as the run: the data-size curve's point above exact (`quarter` and `half` are exact's first
  rows). The run's held-out conversations stay out of its training rows; its new prompts are checked for leaks.
  The run's own 01 records of its prompts go into the variant's 01 journal before 01 starts (`reuse_run_records`:
  as a user doubling a run keeps what it made), so 01 generates the new half only.

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
from eagle3data.audit.run import run_audit
from eagle3data.core.atomic import write_atomic
from eagle3data.core.models import tokenizer_for
from eagle3data.core.params import RunParams
from eagle3data.core.profiles import get_profile
from eagle3data.core.reader import SampleKey, read_run
from eagle3data.core.records import scan_journal
from eagle3data.export.run import run_export
from eagle3data.generate.run import run_generate
from eagle3data.hidden.extract import plan_extract, run_extract
from eagle3data.hidden.verify.checks import NOT_SAMPLED
from eagle3data.prompts.load import load_datasets
from eagle3data.rebuild.run import run_reconstruct, turns_from_exact
from eagle3data.value.online import handoff_fingerprint, online_handoff
from eagle3data.value.peer_variants import PEER_VARIANTS, api_records, peer_run
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
    "quarter": "the exact hand-off, the first quarter of its training rows (the data-size curve)",
    "sampled": "the training prompts regenerated at temperature value.sampled_temperature (seeded) by 01, then 03, "
               "04, 05",
    "sampled_retokenized": "sampled's outputs as an API returns them (text), ids rebuilt by 02, states by 04 for "
                           "those ids (compared with sampled)",
    "double": "twice the prompts (each dataset's limit doubled: the run's and as many new ones), greedy, by 01, 03, "
              "04, 05 (the data-size curve)",
    "text_rule": "the conversations as TorchSpec tokenizes them (the target's template as text, encoded; its "
                 "assistant mask: value/text_rule.py), states by 04 for those ids",
    "template_other": "the conversations as SpecForge's data.train_data_path tokenizes them with its own template "
                      "registry (qwen: another system prompt than the served one), states by 04 for those ids",
}
GENERATED = ("sampled", "double")        # 01 makes their records again
# the variant a derived one is compared with, where that is not exact (paired over the same evaluation prompts)
COMPARED_WITH = {"sampled_retokenized": "sampled"}
# the variant a derived one's data is made from, where that is not the run itself
MADE_FROM = {"sampled_retokenized": "sampled"}
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
    elif variant in PEER_VARIANTS:
        hidden["min_proof_level"] = "text"  # a peer's rows: 02 proved nothing of them (proof `text`: peer_variants)
    elif variant in ("retokenized", "sampled_retokenized"):
        # a user who re-tokenizes API text trains on every rebuilt record: a non-canonical split re-encodes to another
        # count than the API billed (02's proof then stops at `text`), and dropping those rows would price the
        # re-tokenization with half the data (measured: sampled_retokenized kept 184 of sampled's 368 rows)
        hidden["min_proof_level"] = "text"
    elif variant == "shifted":
        hidden["verify_after"] = False  # verify-hidden's own command judges it below
        export["allow_unverified"] = True
    elif variant == "int8":
        hidden |= {"storage": "int8", "storage_scale": "channel_rms", "layout": "shards"}
    elif variant == "fp8":
        hidden |= {"storage": "fp8_e4m3", "storage_scale": "token", "layout": "speculators"}
    data = params.model_dump(mode="json")
    if variant == "sampled":
        data["generate"]["sampling"]["temperature"] = params.value.sampled_temperature
    elif variant == "double":
        for d in data["datasets"]:
            if d.get("limit") is None:
                raise ValueStageError(f"datasets: {d['name']} has no limit: variant double doubles each dataset's "
                                      "limit (the run's prompts and as many new ones); give the run a limit")
            d["limit"] *= 2
    data["output_root"] = str(params.run_dir / "value" / variant)
    data["run_name"] = "run"
    data["hidden"] |= hidden
    data["hidden"]["out_dir"] = None
    data["export"] |= export
    data["value"]["enabled"] = False
    return RunParams.model_validate(data)


def variant_records(params: RunParams, variant: str, train_keys: list[str], *, source: Path | None = None,
                    held: frozenset[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """The training conversations' records of the run (or of `source`, a run folder 01 or another variant made),
    as this variant's run folder holds them (per dataset). `held`: conversations kept out (the run's held-out
    evaluation ones); without it, the conversations of `train_keys` are kept."""
    keep = {_conv(k) for k in train_keys}
    view = read_run(source or params.run_dir, [d.name for d in params.datasets], rebuilt=False, verdicts=False)
    out: dict[str, list[dict[str, Any]]] = {}
    tok = profile = replies = None
    for name, lines in view.datasets.items():
        recs = [r for r in lines.records()
                if (_conv(str(SampleKey.of(r))) not in held if held is not None
                    else _conv(str(SampleKey.of(r))) in keep)]
        if variant in ("retokenized", "sampled_retokenized"):
            exact = [r for r in recs if r.get("output_ids") is not None]
            tok, profile = tok or tokenizer_for(params), profile or get_profile(params.profile)
            turns = turns_from_exact(exact, tok, profile)  # 02's one split of output ids into API text
            recs = api_records(exact, [{"reasoning": t.reasoning, "content": t.content, "tool_calls": t.tool_calls,
                                         "finish_reason": r["finish_reason"], "usage": r.get("usage")}
                                        for r, t in zip(exact, turns)], variant)
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
                    api_records(with_reply, [{"reasoning": None, "content": got[str(r["sample_id"])][0],
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


def _fingerprint(vp: RunParams, train_keys: list[str], made_from: str | None = None) -> str:
    # what makes the data: the params but where it goes and 06's own section (the variants asked for, their order),
    # and the fingerprint of the variant it is made from (sampled_retokenized: sampled's)
    blob = orjson.dumps({"params": vp.model_dump(mode="json", exclude={"output_root", "run_name", "value"}),
                         "keys": sorted(train_keys), "made_from": made_from}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(blob).hexdigest()[:16]


def build_variant(params: RunParams, variant: str, train_keys: list[str], say: Callable[[str], None],
                  stop: Callable[[], bool] | None = None, *, held: frozenset[str] | None = None) -> VariantData:
    """Make this variant's hand-off with the stages in `value/<variant>/run/` (kept when built with the same params);
    `stop()` is asked between the stages (a stopped build resumes through them). `held`: the run's held-out
    conversations, kept out of a regenerated variant's rows (without it: the conversations of `train_keys`)."""
    def check_stop(before: str) -> None:
        if stop is not None and stop():
            raise ValueStopped(f"{variant}: stopped before {before} (what the stages wrote is kept)")

    vp = variant_params(params, variant)
    vrun = vp.run_dir
    handoff = vrun / "export" / "speculators"
    base = build_variant(params, MADE_FROM[variant], train_keys, say, stop, held=held) if variant in MADE_FROM else None
    base_keys = [str(k) for k in json.loads((base.handoff / "handoff.json").read_text(encoding="utf-8"))["keys"]
                 ] if base is not None else None
    fp = _fingerprint(vp, base_keys or train_keys, base.info.get("fingerprint") if base is not None else None)
    order = train_keys if base is None else [base_keys[i] for i in base.rows]  # training order: exact's (sampled's)
    rows_held = held if variant in GENERATED or base is not None else None  # rows of its own: all but held-out ones
    built = vrun / BUILT
    if built.exists() and (handoff / "handoff.json").exists():
        info = json.loads(built.read_text(encoding="utf-8"))
        if info.get("fingerprint") == fp:
            say(f"{variant}: data built earlier, kept ({handoff})")
            if variant == "retokenized" and "ids_differ_from_exact" not in info:
                info["ids_differ_from_exact"] = ids_differ(params.run_dir / "export" / "speculators", handoff)
            return VariantData(handoff, _train_rows(handoff, order, rows_held), info)
    _start_build(vrun, fp, say)
    t0 = time.monotonic()
    info: dict[str, Any] = {"variant": variant, "fingerprint": fp}
    source = None
    if variant in GENERATED:  # 01 makes the records again, in its own run folder (it resumes there)
        gp = _generate_params(vp)
        check_stop("01")
        reused = reuse_run_records(params, gp) if variant == "double" else 0
        if reused:
            say(f"{variant}: {reused:,} of the run's own 01 records copied into {gp.run_dir / 'records'} (its "
                "prompts are the first half of the doubled ones): 01 generates the others")
        say(f"{variant}: 01 generates {sum(d.limit or 0 for d in gp.datasets):,} prompts' outputs "
            f"(temperature {gp.generate.sampling.temperature}, seed {gp.generate.sampling.seed}, "
            f"{gp.generate.backend}) into {gp.run_dir}")
        g = run_generate(gp, progress=False)
        if g.status != "finished":
            if stop is not None and stop():
                raise ValueStopped(f"{variant}: 01 stopped ({g.stop_reason}); what it wrote is kept, it resumes")
            raise ValueStageError(f"{gp.run_dir / 'ledger.json'}: 01 for variant {variant} ended {g.status}: "
                                  f"{g.stop_reason}")
        failed = [r for r in read_run(gp.run_dir, rebuilt=False, verdicts=False).records()
                  if r.get("finish_reason") == "error"]
        if failed:  # a measurement trains on every prompt's output: 01's failures stop it (01 resumes them)
            raise ValueStageError(f"{gp.run_dir / 'records'}: 01 for variant {variant} failed {len(failed)} "
                                  f"request(s), first {SampleKey.of(failed[0])}: "
                                  f"{str(failed[0].get('error'))[:200]}")
        info["generate"] = {"run": str(gp.run_dir), "temperature": gp.generate.sampling.temperature,
                            "seed": gp.generate.sampling.seed, "new_records": g.new_records,
                            "reused_from_run": reused, "seconds": round(g.seconds, 1)}
        source = gp.run_dir
    elif base is not None:
        source = base.handoff.parents[1]  # the run folder the base variant's 05 exported
    (vrun / "records").mkdir(parents=True, exist_ok=True)
    if variant in PEER_VARIANTS:  # the peer's rows as 02's lines, the records as an API writes them (peer_variants)
        check_stop("the peer's rows")
        recs, info["peer"] = peer_run(params, variant, train_keys, vrun, say)
    else:
        recs = variant_records(params, variant, base_keys or train_keys, source=source,
                               held=held if variant in GENERATED else None)
    for name, rs in recs.items():
        write_atomic(vrun / "records" / f"{name}.jsonl", b"".join(orjson.dumps(r) + b"\n" for r in rs))
    info["records"] = {n: len(r) for n, r in recs.items()}
    if variant in GENERATED:  # 03 audits them, as on the run: 04's mix takes only what passed
        check_stop("03")
        run_audit(vp, progress=False)
        a = json.loads((vrun / "audit" / "summary.json").read_text(encoding="utf-8"))
        info["audit"] = {k: a.get(k) for k in ("records", "records_failed", "records_truncated", "output_tokens")}

    if variant in ("retokenized", "dataset_replies", "sampled_retokenized"):
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
    if variant == "retokenized" or variant in PEER_VARIANTS:  # retokenized 0: exact's ids, Δτ a second 04's noise
        info["ids_differ_from_exact"] = ids_differ(params.run_dir / "export" / "speculators", handoff) | (
            {"kinds": info["peer"]["kinds"]} if variant in PEER_VARIANTS else {})  # a peer's kinds: to the summary
    if base is not None:  # the rows whose rebuilt ids are not the ids the target sampled
        info[f"ids_differ_from_{MADE_FROM[variant]}"] = ids_differ(base.handoff, handoff)
    info["seconds"] = round(time.monotonic() - t0, 1)
    write_atomic(built, json.dumps(info, indent=1).encode())
    return VariantData(handoff, _train_rows(handoff, order, rows_held), info)


STARTED = "building.json"
STAGE_OUTPUTS = ("records", "reconstruct", "audit", "hidden", "export")


def _start_build(vrun: Path, fp: str, say: Callable[[str], None]) -> None:
    """Before a build: what an earlier build of other data left in the variant's run folder goes (04 resumes by
    sample key: a store of other ids under the same keys would be kept, and verify-hidden fails it); a stopped
    build of the same data is resumed."""
    import shutil

    prev = next((json.loads(f.read_text(encoding="utf-8")).get("fingerprint")
                 for f in (vrun / BUILT, vrun / STARTED) if f.exists()), None)
    if prev is not None and prev != fp:
        say(f"{vrun}: built from other data or params before: its stage outputs are made again")
        (vrun / BUILT).unlink(missing_ok=True)
        for name in STAGE_OUTPUTS:
            shutil.rmtree(vrun / name, ignore_errors=True)
    vrun.mkdir(parents=True, exist_ok=True)
    write_atomic(vrun / STARTED, json.dumps({"fingerprint": fp}).encode())


def _generate_params(vp: RunParams) -> RunParams:
    """01's params for a regenerated variant: the variant's, in `value/<variant>/gen_<what 01 reads>/`: a folder per
    model, datasets and sampling, so 01 resumes only what the same settings began (its resume keeps every record
    already written: a temperature changed in place would keep the other temperature's records)."""
    data = vp.model_dump(mode="json")
    what = {k: data[k] for k in ("model", "datasets", "generate", "profile")}
    data["run_name"] = "gen_" + hashlib.sha256(orjson.dumps(what, option=orjson.OPT_SORT_KEYS)).hexdigest()[:8]
    return RunParams.model_validate(data)


def reuse_run_records(params: RunParams, gp: RunParams) -> int:
    """Copy the run's own 01 records into the 01 journal of `gp` (a regenerated variant's 01 params) before it
    starts, so 01 resumes past them: only into a journal not yet begun (journals are never rewritten), only records
    of prompts `gp` plans, never an error, and only records 01 would write with `gp`'s settings (model, profile and
    sampling as each record states them: at T > 0 a draw 01 could have made). Returns how many were copied."""
    want = {"model": gp.model.name, "profile": gp.profile,
            "sampling": gp.generate.sampling.model_dump(mode="json", exclude_none=True)}
    planned = {name: {str(SampleKey.of(p)) for p in ps.prompts} for name, ps in load_datasets(gp).items()}
    copied = 0
    for name, keys in planned.items():
        dest = gp.run_dir / "records" / f"{name}.jsonl"
        src = params.run_dir / "records" / f"{name}.jsonl"
        if dest.exists() or not src.exists():
            continue
        kept = [r for r in scan_journal(src).records
                if r.get("finish_reason") != "error" and r.get("ids_exact") and r.get("output_ids") is not None
                and _conv(str(SampleKey.of(r))) in keys and all(r.get(k) == v for k, v in want.items())]
        if kept:
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(dest, b"".join(orjson.dumps(r) + b"\n" for r in kept))
            copied += len(kept)
    return copied


def _train_rows(handoff: Path, order: list[str], held: frozenset[str] | None) -> list[int]:
    """The rows a variant trains on. Without `held`: its rows of `order` (`_rows_of`). With it (a variant with
    rows of its own: regenerated, or made from one): every row whose conversation is not held out, those of
    `order` first in its order, then the others in the hand-off's order."""
    if held is None:
        return _rows_of(handoff, order)
    keys = [str(k) for k in json.loads((handoff / "handoff.json").read_text(encoding="utf-8")).get("keys") or []]
    at = {k: i for i, k in enumerate(keys)}
    first = [at[k] for k in order if k in at and _conv(k) not in held]
    seen = set(first)
    return first + [i for i, k in enumerate(keys) if i not in seen and _conv(k) not in held]


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
                 say: Callable[[str], None], stop: Callable[[], bool] | None = None, *,
                 held: frozenset[str] | None = None) -> VariantData:
    """The hand-off and rows this variant trains on."""
    if variant == "exact":
        return VariantData(handoff, list(train_rows))
    if variant == "half":
        return VariantData(handoff, list(train_rows[: max(1, len(train_rows) // 2)]))
    if variant == "quarter":
        return VariantData(handoff, list(train_rows[: max(1, len(train_rows) // 4)]))
    if variant == "online":  # 05's own folder, in exact's row order; the states come during training (value.online)
        online = online_handoff(params.run_dir)
        return VariantData(online, _rows_of(online, train_keys), {"fingerprint": handoff_fingerprint(online)})
    return build_variant(params, variant, train_keys, say, stop, held=held)
