"""Training mix: which samples 04_extract_hidden extracts, in which order, and why others are out.

This is the one selection rule: 04 extracts exactly the mix and 05 exports exactly the mix
(same keys, same order); every sample left out has exactly one reason from `DROP_REASONS`.
`build_mix(params)` reads the run through the one reader (`reader.read_run`: the record of a
key is its latest line, superseded lines are dropped as such; exact ids from 01, rebuilt ids
for API records from 02), drops real duplicates and sequences longer than the model's
context, keeps only records that passed 03's audit (unless `hidden.include_failed`), drops
keeps one turn per conversation when `hidden.train_turns` is `last`, drops
duplicate sequences, applies per-dataset caps, then per-dataset weights
(the largest mix whose datasets hold the asked shares of tokens or samples, no sample
repeated), shuffles with a seed, and writes `hidden/mix.parquet` (one row per sample: ids,
loss mask, provenance) plus `hidden/mix_manifest.json` (counts and tokens per dataset and
source; every drop and its reason). The result is deterministic: the same records and params give the same mix.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from eagle3data.core.atomic import atomic_path, write_atomic
from eagle3data.core.params import RunParams
from eagle3data.core.reader import RunFileError, RunView, Sample, SampleKey, read_run
from eagle3data.rebuild.proof import PROOF_RANK

__all__ = ["DROP_REASONS", "MANIFEST_FILE", "MIX_FILE", "Mix", "MixError", "MixMissing", "build_mix", "hidden_dir",
           "mix_figures", "read_mix", "source_sequences", "tmp_tag", "turn_figures", "write_mix"]

MIX_FILE = "mix.parquet"
MANIFEST_FILE = "mix_manifest.json"

# Why a journal line is not in the mix (the manifest counts each; one reason per line), in
# the order the rule applies them.
DROP_REASONS = {
    "superseded": "an earlier journal line of the sample, replaced by a later one (a retried error)",
    "error": "generation ended in an error or abort",
    "duplicate_key": "the sample has two completed records (a real duplicate): which one is the model's is unknown",
    "no_ids": "no output_ids in the record and no rebuilt ids from 02_reconstruct",
    "bad_ids": "input_ids and loss_mask differ in length, or the mask trains nothing",
    "too_long": "prompt + output longer than the model's context (model.max_context or the config's)",
    "truncated": "cut at max_new_tokens (hidden.drop_truncated)",
    "not_audited": "no 03_audit verdict although the audit ran",
    "audit_failed": "failed a 03_audit check (hidden.include_failed is off)",
    "proof_too_low": "rebuilt API ids whose 02 proof level is below hidden.min_proof_level",
    "earlier_turn": "a turn of a conversation below its last usable turn (hidden.train_turns: last)",
    "duplicate_ids": "the same input_ids as an earlier record (hidden.dedupe)",
    "over_cap": "beyond the dataset's cap (hidden.dataset_caps), chosen by the seeded shuffle",
    "over_weight": "beyond the dataset's share (hidden.dataset_weights), chosen by the seeded shuffle",
    "capture_failed": "04 failed it after its retries, accepted by hidden.allow_failed_samples (store/failures.py)",
}


class MixError(RunFileError):
    """An input of the mix is unusable; for a malformed file the message names file, line and field."""

    @classmethod
    def missing(cls, path: Path, line: int, fields: list[str]) -> MixError:
        """The mix's wording: the first missing field, in backticks."""
        return cls(f"{path}:{line}: missing field `{fields[0]}`", path=path, line=line, fields=tuple(fields))


class MixMissing(MixError, FileNotFoundError):
    """04 has not written the mix this needs (a user error: one line, exit 2)."""


def hidden_dir(params: RunParams) -> Path:
    """Where 04 writes: `hidden.out_dir` or `<run>/hidden/`."""
    return Path(params.hidden.out_dir) if params.hidden.out_dir else params.run_dir / "hidden"


def source_sequences(params: RunParams, view: RunView | None = None) -> dict[SampleKey, Sample]:
    """Every resolvable sequence of the run's chosen datasets by key (the records; errors left out)."""
    view = view or read_run(params.run_dir, _chosen(params), error=MixError, verdicts=False)
    return view.samples(_chosen(params))


def _chosen(params: RunParams) -> list[str]:
    names = [d.name for d in params.datasets]
    if params.hidden.datasets is None:
        return names
    unknown = [n for n in params.hidden.datasets if n not in names]
    if unknown:
        raise MixError(f"hidden.datasets names datasets the run does not have: {unknown}; run has {names}")
    return [n for n in names if n in params.hidden.datasets]


@dataclass
class Mix:
    """The training mix: samples in shuffled order, the manifest, and where both were written."""

    samples: list[Sample]
    manifest: dict[str, Any]
    path: Path | None = None
    dropped: list[dict[str, Any]] = field(default_factory=list)
    view: RunView | None = field(default=None, repr=False)  # the run as read to build it (not written)

    def table(self):
        """Per dataset and source: samples, tokens and trained (loss) tokens that went in."""
        import pandas as pd

        rows = [{"dataset": s.dataset, "source": s.source, "ids_exact": s.ids_exact, "samples": 1,
                 "tokens": len(s.input_ids), "loss_tokens": int(sum(s.loss_mask))} for s in self.samples]
        if not rows:
            return pd.DataFrame(columns=["samples", "tokens", "loss_tokens"])
        return pd.DataFrame(rows).groupby(["dataset", "source", "ids_exact"]).sum()

    def weights_table(self):
        """Per dataset: weight, asked and achieved share, and amount kept in `hidden.weight_unit` (empty if unweighted)."""
        import pandas as pd

        w = self.manifest.get("weights")
        cols = ["weight", "asked_share", "achieved_share", "amount"]
        if not w:
            return pd.DataFrame(columns=cols).rename_axis("dataset")
        weights = self.manifest["settings"]["dataset_weights"]
        rows = {n: [weights[n], w["asked"][n], w["achieved"][n], w["amount"][n]] for n in w["asked"]}
        df = pd.DataFrame.from_dict(rows, orient="index", columns=cols).rename_axis("dataset")
        return df.rename(columns={"amount": f"amount ({w['unit']})"})

    def dropped_table(self):
        """Per dataset: how many records each reason kept out."""
        import pandas as pd

        if not self.dropped:
            return pd.DataFrame(columns=["dataset", "reason", "records"]).set_index(["dataset", "reason"])
        df = pd.DataFrame(self.dropped)
        return df.groupby(["dataset", "reason"]).size().rename("records").to_frame()


def build_mix(params: RunParams, *, write: bool = True, view: RunView | None = None,
              max_context: int | None = None) -> Mix:
    """Build the training mix from the run's records, audit verdicts and rebuilt ids; write it under hidden/.

    `max_context`: the longest sequence the model takes (`models.context_limit`); longer
    samples are dropped as `too_long`. None: no limit applied.

    Turn records (`generate.turns: all`: one record, one sample per turn, key `dataset/sample_id#turn`)
    are sequences like any other: each is its prompt ids + its output ids, loss on the output.
    With `hidden.train_turns: last` only the conversation's **last usable turn** stays: the highest
    turn that passed every per-record rule above it (error, ids, length, truncation, audit, proof),
    so a conversation whose final turn failed the audit or ended in an error still gives its last
    good turn (whose prompt holds the model's own earlier turns). The others are dropped as
    `earlier_turn` (with `last_turn`, the turn kept). Dedupe, caps and weights then count that one
    sequence per conversation. Records without a `turn` are not affected.
    """
    hp = params.hidden
    names = _chosen(params)
    view = view or read_run(params.run_dir, names, error=MixError)
    verdicts = view.verdicts
    dropped: list[dict[str, Any]] = []
    per_dataset: dict[str, list[Sample]] = {}
    seen_ids: dict[bytes, str] = {}
    records_read = 0
    conv_of: dict[SampleKey, tuple[str, int]] = {}  # a turn sample's conversation (sample_id) and turn

    def drop(rec_or_s: Any, reason: str, **extra: Any) -> None:
        key = rec_or_s.key if isinstance(rec_or_s, Sample) else SampleKey.of(rec_or_s)
        dropped.append({"key": str(key), "dataset": key.dataset, "sample_id": key.sample_id, "turn": key.turn,
                        "reason": reason, **extra})

    for name in names:
        lines = view.datasets[name]
        records_read += len(lines.lines)
        cands: list[Sample] = []
        for rec, is_record, dup in zip(lines.lines, lines.is_record, lines.duplicate):
            if not is_record:
                drop(rec, "superseded")
                continue
            if rec.get("finish_reason") in ("error", "abort"):
                drop(rec, "error")
                continue
            if dup:
                drop(rec, "duplicate_key")
                continue
            s = view.sample(rec)
            if s is None:
                drop(rec, "no_ids")
                continue
            if len(s.input_ids) != len(s.loss_mask) or not any(s.loss_mask):
                drop(rec, "bad_ids")
                continue
            if max_context and len(s.input_ids) > max_context:
                drop(rec, "too_long", tokens=len(s.input_ids), max_context=max_context)
                continue
            v = verdicts.get(s.key) if verdicts is not None else None
            if hp.drop_truncated and (rec.get("finish_reason") == "length" or (v or {}).get("truncated")):
                drop(rec, "truncated")
                continue
            if verdicts is not None and not hp.include_failed:
                if v is None:
                    drop(rec, "not_audited")
                    continue
                if v.get("failed"):
                    drop(rec, "audit_failed", checks=list(v["failed"]))
                    continue
            level = (view.rebuilt.get(s.key) or {}).get("proof_level") if rec.get("output_ids") is None else None
            if level is not None and PROOF_RANK.get(level, -1) < PROOF_RANK[hp.min_proof_level]:
                drop(rec, "proof_too_low", proof_level=level)
                continue
            turn = rec.get("turn")
            if turn is not None and turn == turn:
                conv_of[s.key] = (str(rec["sample_id"]), int(turn))
            cands.append(s)
        if hp.train_turns == "last":
            cands = _last_turns(cands, conv_of, drop)
        # deterministic order before dedupe/caps: journals are in completion order
        cands.sort(key=lambda s: (_sort_key(s.sample_id), -1 if s.turn is None else s.turn))
        uniq: list[Sample] = []
        for s in cands:
            h = hashlib.blake2b(np.asarray(s.input_ids, dtype=np.int64).tobytes(), digest_size=16).digest()
            if hp.dedupe and h in seen_ids:
                drop(s, "duplicate_ids", same_as=seen_ids[h])
                continue
            seen_ids.setdefault(h, str(s.key))
            uniq.append(s)
        cap = hp.dataset_caps.get(name)
        if cap is not None and len(uniq) > cap:
            rng = np.random.default_rng([hp.seed, _name_seed(name)])
            uniq = _keep_only(uniq, set(rng.permutation(len(uniq))[:cap].tolist()), "over_cap", drop)
        per_dataset[name] = uniq

    shares = _apply_weights(params, per_dataset, drop) if hp.dataset_weights else None
    kept = [s for name in per_dataset for s in per_dataset[name]]
    turns = turn_figures(kept, conv_of)
    order = np.random.default_rng(hp.seed).permutation(len(kept))
    samples = [kept[i] for i in order]
    manifest = _manifest(params, samples, dropped, verdicts is not None, records_read, shares, max_context)
    manifest["turns"] = turns
    mix = Mix(samples, manifest, dropped=dropped, view=view)
    if write:
        mix.path = write_mix(mix, hidden_dir(params))
    return mix


def _last_turns(cands: list[Sample], conv_of: dict[SampleKey, tuple[str, int]], drop: Any) -> list[Sample]:
    """`hidden.train_turns: last`: per conversation, its highest remaining turn; the others `earlier_turn`."""
    last: dict[str, int] = {}
    for s in cands:
        if s.key in conv_of:
            conv, t = conv_of[s.key]
            last[conv] = max(t, last.get(conv, t))
    out = []
    for s in cands:
        if s.key in conv_of and conv_of[s.key][1] < last[conv_of[s.key][0]]:
            drop(s, "earlier_turn", last_turn=last[conv_of[s.key][0]])
            continue
        out.append(s)
    return out


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def turn_figures(samples: list[Sample], conv_of: dict[SampleKey, tuple[str, int]]) -> dict[str, int]:
    """What per-turn sequences cost in the mix: a turn's sequence starts with (most of) the earlier turns'.

    Over the turn samples among `samples` (`conv_of`: sample key -> (conversation, turn)):
    `turn_samples`, `conversations`, `tokens` (all their tokens), `repeated_prefix_tokens` (per
    turn, the longest prefix it shares with an earlier turn's sequence of the same conversation in
    the mix: positions whose hidden states are stored again, identical, since a state depends only
    on the tokens up to it), and `last_turn_samples` / `last_turn_tokens` (each conversation's
    highest turn in the mix: what `hidden.train_turns: last` keeps, before dedupe, caps and weights).
    """
    convs: dict[tuple[str, str], list[tuple[int, Sample]]] = {}
    for s in samples:
        if s.key in conv_of:
            conv, t = conv_of[s.key]
            convs.setdefault((s.dataset, conv), []).append((t, s))
    tokens = repeated = last_tokens = 0
    for turns in convs.values():
        turns.sort(key=lambda x: x[0])
        arrays = [np.asarray(s.input_ids, dtype=np.int64) for _, s in turns]
        for j, a in enumerate(arrays):
            tokens += len(a)
            repeated += max((_shared_prefix(a, b) for b in arrays[:j]), default=0)
        last_tokens += len(arrays[-1])
    return {"turn_samples": sum(len(v) for v in convs.values()), "conversations": len(convs), "tokens": tokens,
            "repeated_prefix_tokens": repeated, "last_turn_samples": len(convs), "last_turn_tokens": last_tokens}


def _size(s: Sample, unit: str) -> int:
    """A sample's amount in `hidden.weight_unit`."""
    if unit == "samples":
        return 1
    return len(s.input_ids) if unit == "tokens" else int(sum(s.loss_mask))


def _apply_weights(params: RunParams, per_dataset: dict[str, list[Sample]], drop: Any) -> dict[str, Any]:
    """Cut each dataset to its share of the largest mix that meets `hidden.dataset_weights`.

    With amounts A_i (after caps) and weights w_i, the mix holds T * w_i of dataset i where
    T = min over w_i > 0 of A_i / w_i: the scarcest dataset for its weight is kept whole, the
    others are cut (a seeded choice: the longest prefix of a shuffle that fits). Nothing is
    repeated; the trainer can still oversample. Returns the asked and achieved shares.
    """
    hp = params.hidden
    unit, weights = hp.weight_unit, hp.dataset_weights
    missing = [n for n in per_dataset if n not in weights]
    if missing:
        raise MixError(f"hidden.dataset_weights has no weight for {missing} (datasets in the mix: "
                       f"{list(per_dataset)}): give every one a weight, 0 to leave it out")
    sizes = {n: [_size(s, unit) for s in ss] for n, ss in per_dataset.items()}
    amount = {n: sum(sz) for n, sz in sizes.items()}
    empty = [n for n in per_dataset if weights[n] > 0 and amount[n] == 0]
    if empty:
        raise MixError(f"hidden.dataset_weights gives {empty} a share, but no samples of theirs are left after "
                       "the filters and caps: the weighted mix would be empty. Set their weight to 0.")
    scale = min(amount[n] / weights[n] for n in per_dataset if weights[n] > 0)
    got: dict[str, int] = {}
    for n, ss in per_dataset.items():
        target = scale * weights[n] * (1 + 1e-9)  # the scarcest dataset's own total must fit
        rng = np.random.default_rng([hp.seed, _name_seed(n), 1])
        keep, used = set(), 0
        for i in rng.permutation(len(ss)).tolist():
            if used + sizes[n][i] > target:
                break
            keep.add(i)
            used += sizes[n][i]
        per_dataset[n] = _keep_only(ss, keep, "over_weight", drop)
        got[n] = used
    total_w = sum(weights[n] for n in per_dataset)
    total = sum(got.values()) or 1
    return {"unit": unit,
            "asked": {n: weights[n] / total_w for n in per_dataset},
            "achieved": {n: got[n] / total for n in per_dataset},
            "amount": got}


def _keep_only(samples: list[Sample], keep: set[int], reason: str, drop: Any) -> list[Sample]:
    """The samples whose index is in `keep`, in order; the others are dropped with `reason`."""
    for i, s in enumerate(samples):
        if i not in keep:
            drop(s, reason)
    return [s for i, s in enumerate(samples) if i in keep]


def _sort_key(sid: str) -> tuple[int, Any]:
    return (0, int(sid), "") if sid.lstrip("-").isdigit() else (1, 0, sid)


def _name_seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


def mix_figures(samples: list[Sample], dropped: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's counts of samples (per dataset, source) and drops (per reason), its fingerprint (`drop_failed`)."""
    per: dict[str, dict[str, Any]] = {}
    for s in samples:
        d = per.setdefault(s.dataset, {"samples": 0, "tokens": 0, "loss_tokens": 0, "by_source": {}})
        n, nl = len(s.input_ids), int(sum(s.loss_mask))
        d["samples"] += 1
        d["tokens"] += n
        d["loss_tokens"] += nl
        src = d["by_source"].setdefault(s.source, {"samples": 0, "tokens": 0, "ids_exact": 0})
        src["samples"] += 1
        src["tokens"] += n
        src["ids_exact"] += int(s.ids_exact)
    drops: dict[str, dict[str, int]] = {}
    for d in dropped:
        drops.setdefault(d["dataset"], {})[d["reason"]] = drops.get(d["dataset"], {}).get(d["reason"], 0) + 1
    fingerprint = hashlib.blake2b("\n".join(str(s.key) for s in samples).encode(), digest_size=16).hexdigest()
    return {"samples": len(samples), "tokens": sum(d["tokens"] for d in per.values()), "fingerprint": fingerprint,
            "loss_tokens": sum(d["loss_tokens"] for d in per.values()), "datasets": per, "dropped_counts": drops,
            "drop_reasons": {k: DROP_REASONS[k] for k in sorted({d["reason"] for d in dropped})}, "dropped": dropped}


def _manifest(params: RunParams, samples: list[Sample], dropped: list[dict[str, Any]], audited: bool,
              records_read: int, shares: dict[str, Any] | None, max_context: int | None) -> dict[str, Any]:
    hp = params.hidden
    c = mix_figures(samples, dropped)
    return {
        "records_read": records_read,
        **{k: c[k] for k in ("samples", "tokens", "loss_tokens", "fingerprint")},
        "audit_found": audited,
        "audit_applied": audited and not hp.include_failed,
        "audit_note": (
            "audit/verdicts.jsonl found: only records that passed every check are in"
            if audited and not hp.include_failed
            else "audit/verdicts.jsonl found but hidden.include_failed is on: failed records are in"
            if audited
            else "no audit/verdicts.jsonl (03_audit has not run): NO audit filter applied"
        ),
        "settings": {"seed": hp.seed, "dataset_caps": hp.dataset_caps, "dataset_weights": hp.dataset_weights,
                     "weight_unit": hp.weight_unit, "datasets": _chosen(params),
                     "include_failed": hp.include_failed, "drop_truncated": hp.drop_truncated,
                     "dedupe": hp.dedupe, "max_context": max_context, "min_proof_level": hp.min_proof_level,
                     "train_turns": hp.train_turns},
        "datasets": c["datasets"],
        "weights": shares,
        **{k: c[k] for k in ("dropped_counts", "drop_reasons", "dropped")},
    }


def tmp_tag() -> str:
    """A temp-file suffix unique to this process on this host (workers on a shared disk write the same files)."""
    import socket

    return f".tmp-{socket.gethostname()}-{os.getpid()}"


def write_mix(mix: Mix, out_dir: Path) -> Path:
    """Write `mix.parquet` and `mix_manifest.json` atomically (safe when several workers write the same mix)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "position": pa.array(range(len(mix.samples)), pa.int64()),
        "dataset": pa.array([s.dataset for s in mix.samples], pa.string()),
        "key": pa.array([str(s.key) for s in mix.samples], pa.string()),
        "sample_id": pa.array([s.sample_id for s in mix.samples], pa.string()),
        "turn": pa.array([s.turn for s in mix.samples], pa.int32()),
        "source": pa.array([s.source for s in mix.samples], pa.string()),
        "ids_exact": pa.array([s.ids_exact for s in mix.samples], pa.bool_()),
        "input_ids": pa.array([s.input_ids for s in mix.samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([s.loss_mask for s in mix.samples], pa.list_(pa.uint8())),
    })
    tag = tmp_tag()
    path = out_dir / MIX_FILE
    with atomic_path(path, tmp_suffix=tag) as tmp:
        pq.write_table(table, str(tmp))
    write_atomic(out_dir / MANIFEST_FILE, orjson.dumps(mix.manifest, option=orjson.OPT_INDENT_2), tmp_suffix=tag)
    return path


def read_mix(out_dir: str | Path) -> Mix:
    """Read a written mix back (samples in mix order, and its manifest)."""
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    path = out_dir / MIX_FILE
    if not path.exists():
        raise MixMissing(f"no training mix at {path}: run 04 first (eagle3data run PARAMS --only 04)")
    t = pq.read_table(path).to_pydict()
    turns = t.get("turn") or [None] * len(t["dataset"])
    samples = [Sample(d, sid, src, ex, None, ids, mask, turn=tn) for d, sid, tn, src, ex, ids, mask in
               zip(t["dataset"], t["sample_id"], turns, t["source"], t["ids_exact"], t["input_ids"], t["loss_mask"])]
    manifest = orjson.loads((out_dir / MANIFEST_FILE).read_bytes())
    return Mix(samples, manifest, path, dropped=manifest.get("dropped", []))
