"""Training mix: which samples 04_extract_hidden extracts, in which order, and why others are out.

This is the one selection rule: 04 extracts exactly the mix and 05 exports exactly the mix
(same keys, same order); every sample left out has exactly one reason from `DROP_REASONS`.
`build_mix(params)` reads the run as a stream (`core.stream`: the record of a key is its latest
line, superseded lines are dropped as such; exact ids from 01, rebuilt ids for API records from
02), drops real duplicates and sequences longer than the model's context, keeps only records
that passed 03's audit (unless `hidden.include_failed`), keeps one turn per conversation when
`hidden.train_turns` is `last`, drops duplicate sequences, applies per-dataset caps, then
per-dataset weights (the largest mix whose datasets hold the asked shares of tokens or samples,
no sample repeated), shuffles with a seed, and writes `hidden/mix.parquet` (one row per sample:
ids, loss mask, provenance) plus `hidden/mix_manifest.json` (counts and tokens per dataset and
source; every drop and its reason). The same records and params give the same mix.

Memory is set by `hidden.mix_chunk_rows`, not by the run: records are resolved a chunk at a time
and the rule keeps only small facts per sample (`rows.Entry`: key, lengths, a digest of its ids;
`rows.py` reads the run as a stream). The samples are read back in mix order a chunk at a time
(`Mix.iter_samples`: 05, `write_mix`), or all at once (`Mix.samples`: small runs, 04's capture).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import orjson

from eagle3data.core.atomic import atomic_path, tmp_tag, write_atomic
from eagle3data.core.params import RunParams
from eagle3data.core.reader import RunFileError, RunView, Sample, SampleKey, read_run
from eagle3data.hidden.mix.rows import Entry, RunRows, entry, last_turns, turn_figures
from eagle3data.rebuild.proof import PROOF_RANK

MIX_FILE = "mix.parquet"
MANIFEST_FILE = "mix_manifest.json"
CHUNK = 256  # samples at a time where no setting says (`hidden.mix_chunk_rows`, `export.chunk_rows`)

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


class Mix:
    """The training mix in mix order: its samples' facts (`entries`, `keys`), the manifest and the drops; the
    samples themselves read back `chunk` at a time (`iter_samples`), or all at once into memory (`samples`)."""

    def __init__(self, samples: list[Sample] | None = None, manifest: dict[str, Any] | None = None,
                 path: Path | None = None, dropped: list[dict[str, Any]] | None = None, view: RunView | None = None,
                 *, entries: list[Entry] | None = None, keys: list[SampleKey] | None = None,
                 chunks: Callable[[int, bool], Iterator[list[Sample]]] | None = None, chunk: int = CHUNK) -> None:
        self._samples = None if samples is None else list(samples)
        self.manifest, self.path, self.view = manifest or {}, path, view
        self.dropped = dropped if dropped is not None else []
        self._entries, self._keys, self._chunks, self.chunk = entries, keys, chunks, chunk

    def iter_samples(self, chunk: int | None = None, *, keep_record: bool = False) -> Iterator[list[Sample]]:
        """The samples in mix order, lists of at most `chunk` (`keep_record`: with their records, where built here)."""
        n = max(1, int(chunk or self.chunk))
        if self._samples is not None or self._chunks is None:
            ss = self._samples or []
            return (ss[i:i + n] for i in range(0, len(ss), n))
        return self._chunks(n, keep_record)

    @property
    def samples(self) -> list[Sample]:
        """Every sample of the mix, held in memory (small runs, 04's capture); 05 reads `iter_samples`."""
        if self._samples is None:
            self._samples = [s for c in self.iter_samples() for s in c]
        return self._samples

    @property
    def entries(self) -> list[Entry]:
        if self._entries is None:
            self._entries = [entry(s) for c in self.iter_samples() for s in c]
        return self._entries

    @property
    def keys(self) -> list[SampleKey]:
        if self._keys is None:
            self._keys = [s.key for s in self._samples] if self._samples is not None else [e.key for e in self.entries]
        return self._keys

    def __len__(self) -> int:
        return len(self._samples) if self._samples is not None else len(self.keys)

    def table(self):
        """Per dataset and source: samples, tokens and trained (loss) tokens that went in."""
        import pandas as pd

        rows = [{"dataset": e.dataset, "source": e.source, "ids_exact": e.ids_exact, "samples": 1,
                 "tokens": e.tokens, "loss_tokens": e.loss_tokens} for e in self.entries]
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


def build_mix(params: RunParams, *, write: bool = True, max_context: int | None = None,
              error: type[RunFileError] = MixError) -> Mix:
    """Build the training mix from the run's records, audit verdicts and rebuilt ids; write it under hidden/.

    `max_context`: the longest sequence the model takes (`models.context_limit`); longer
    samples are dropped as `too_long`. None: no limit applied. `error`: what a malformed run file raises (05: its own).

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
    names, chunk = _chosen(params), hp.mix_chunk_rows
    run = RunRows(params.run_dir, names, error)
    verdicts = run.verdicts
    dropped: list[dict[str, Any]] = []
    per_dataset: dict[str, list[Entry]] = {}
    seen_ids: dict[bytes, str] = {}
    records_read = 0

    def drop(k: Any, reason: str, **extra: Any) -> None:
        key = k if isinstance(k, SampleKey) else k.key
        dropped.append({"key": str(key), "dataset": key.dataset, "sample_id": key.sample_id, "turn": key.turn,
                        "reason": reason, **extra})

    for name in names:
        records_read += len(run.journals[name])
        cands: list[Entry] = []
        for key, finish, is_record, dup, rec in run.lines(name, chunk):
            if not is_record:
                drop(key, "superseded")
                continue
            if finish in ("error", "abort"):
                drop(key, "error")
                continue
            if dup:
                drop(key, "duplicate_key")
                continue
            s, rebuilt = run.resolve(rec)
            if s is None:
                drop(key, "no_ids")
                continue
            if len(s.input_ids) != len(s.loss_mask) or not any(s.loss_mask):
                drop(key, "bad_ids")
                continue
            if max_context and len(s.input_ids) > max_context:
                drop(key, "too_long", tokens=len(s.input_ids), max_context=max_context)
                continue
            v = verdicts.get(s.key) if verdicts is not None else None
            if hp.drop_truncated and (finish == "length" or (v or {}).get("truncated")):
                drop(key, "truncated")
                continue
            if verdicts is not None and not hp.include_failed:
                if v is None:
                    drop(key, "not_audited")
                    continue
                if v.get("failed"):
                    drop(key, "audit_failed", checks=list(v["failed"]))
                    continue
            level = (rebuilt or {}).get("proof_level") if rec.get("output_ids") is None else None
            if level is not None and PROOF_RANK.get(level, -1) < PROOF_RANK[hp.min_proof_level]:
                drop(key, "proof_too_low", proof_level=level)
                continue
            turn = rec.get("turn")
            cands.append(entry(s, (str(rec["sample_id"]), int(turn)) if turn is not None and turn == turn else None,
                               key))
        if hp.train_turns == "last":
            cands = last_turns(cands, drop)
        # deterministic order before dedupe/caps: journals are in completion order
        cands.sort(key=lambda e: (_sort_key(e.key.sample_id), -1 if e.key.turn is None else e.key.turn))
        uniq: list[Entry] = []
        for e in cands:
            if hp.dedupe and e.digest in seen_ids:
                drop(e, "duplicate_ids", same_as=seen_ids[e.digest])
                continue
            seen_ids.setdefault(e.digest, str(e.key))
            uniq.append(e)
        cap = hp.dataset_caps.get(name)
        if cap is not None and len(uniq) > cap:
            rng = np.random.default_rng([hp.seed, _name_seed(name)])
            uniq = _keep_only(uniq, set(rng.permutation(len(uniq))[:cap].tolist()), "over_cap", drop)
        per_dataset[name] = uniq

    shares = _apply_weights(params, per_dataset, drop) if hp.dataset_weights else None
    kept = [e for name in per_dataset for e in per_dataset[name]]
    turns = turn_figures(kept, lambda e: e.conv, lambda es: [s.input_ids for s in run.load([e.key for e in es])], chunk)
    order = np.random.default_rng(hp.seed).permutation(len(kept))
    entries = [kept[i] for i in order]
    manifest = _manifest(params, entries, dropped, verdicts is not None, records_read, shares, max_context)
    manifest["turns"] = turns

    def chunks(n: int, keep_record: bool) -> Iterator[list[Sample]]:
        for i in range(0, len(entries), n):
            yield run.load([e.key for e in entries[i:i + n]], keep_record)

    mix = Mix(None, manifest, dropped=dropped, entries=entries, chunks=chunks, chunk=chunk)
    if write:
        mix.path = write_mix(mix, hidden_dir(params))
    return mix


def _size(e: Entry, unit: str) -> int:
    """A sample's amount in `hidden.weight_unit`."""
    return 1 if unit == "samples" else e.tokens if unit == "tokens" else e.loss_tokens


def _apply_weights(params: RunParams, per_dataset: dict[str, list[Entry]], drop: Any) -> dict[str, Any]:
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
    sizes = {n: [_size(e, unit) for e in es] for n, es in per_dataset.items()}
    amount = {n: sum(sz) for n, sz in sizes.items()}
    empty = [n for n in per_dataset if weights[n] > 0 and amount[n] == 0]
    if empty:
        raise MixError(f"hidden.dataset_weights gives {empty} a share, but no samples of theirs are left after "
                       "the filters and caps: the weighted mix would be empty. Set their weight to 0.")
    scale = min(amount[n] / weights[n] for n in per_dataset if weights[n] > 0)
    got: dict[str, int] = {}
    for n, es in per_dataset.items():
        target = scale * weights[n] * (1 + 1e-9)  # the scarcest dataset's own total must fit
        rng = np.random.default_rng([hp.seed, _name_seed(n), 1])
        keep, used = set(), 0
        for i in rng.permutation(len(es)).tolist():
            if used + sizes[n][i] > target:
                break
            keep.add(i)
            used += sizes[n][i]
        per_dataset[n] = _keep_only(es, keep, "over_weight", drop)
        got[n] = used
    total_w = sum(weights[n] for n in per_dataset)
    total = sum(got.values()) or 1
    return {"unit": unit,
            "asked": {n: weights[n] / total_w for n in per_dataset},
            "achieved": {n: got[n] / total for n in per_dataset},
            "amount": got}


def _keep_only(items: list[Entry], keep: set[int], reason: str, drop: Any) -> list[Entry]:
    """The items whose index is in `keep`, in order; the others are dropped with `reason`."""
    for i, e in enumerate(items):
        if i not in keep:
            drop(e, reason)
    return [e for i, e in enumerate(items) if i in keep]


def _sort_key(sid: str) -> tuple[int, Any]:
    return (0, int(sid), "") if sid.lstrip("-").isdigit() else (1, 0, sid)


def _name_seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


def mix_figures(samples: Iterable[Sample | Entry], dropped: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's counts of samples (per dataset, source) and drops (per reason), its fingerprint (`drop_failed`)."""
    per: dict[str, dict[str, Any]] = {}
    keys = []
    for s in samples:
        e = s if isinstance(s, Entry) else Entry(s.key, s.source, s.ids_exact, len(s.input_ids), int(sum(s.loss_mask)))
        keys.append(str(e.key))
        d = per.setdefault(e.dataset, {"samples": 0, "tokens": 0, "loss_tokens": 0, "by_source": {}})
        d["samples"] += 1
        d["tokens"] += e.tokens
        d["loss_tokens"] += e.loss_tokens
        src = d["by_source"].setdefault(e.source, {"samples": 0, "tokens": 0, "ids_exact": 0})
        src["samples"] += 1
        src["tokens"] += e.tokens
        src["ids_exact"] += int(e.ids_exact)
    drops: dict[str, dict[str, int]] = {}
    for d in dropped:
        drops.setdefault(d["dataset"], {})[d["reason"]] = drops.get(d["dataset"], {}).get(d["reason"], 0) + 1
    fingerprint = hashlib.blake2b("\n".join(keys).encode(), digest_size=16).hexdigest()
    return {"samples": len(keys), "tokens": sum(d["tokens"] for d in per.values()), "fingerprint": fingerprint,
            "loss_tokens": sum(d["loss_tokens"] for d in per.values()), "datasets": per, "dropped_counts": drops,
            "drop_reasons": {k: DROP_REASONS[k] for k in sorted({d["reason"] for d in dropped})}, "dropped": dropped}


def _manifest(params: RunParams, entries: list[Entry], dropped: list[dict[str, Any]], audited: bool,
              records_read: int, shares: dict[str, Any] | None, max_context: int | None) -> dict[str, Any]:
    hp = params.hidden
    c = mix_figures(entries, dropped)
    return {
        "records_read": records_read,
        **{k: c[k] for k in ("samples", "tokens", "loss_tokens", "fingerprint")},
        "audit_found": audited,
        "audit_applied": audited and not hp.include_failed,
        "audit_note": ("audit/verdicts.jsonl found: only records that passed every check are in"
                       if audited and not hp.include_failed else
                       "audit/verdicts.jsonl found but hidden.include_failed is on: failed records are in"
                       if audited else "no audit/verdicts.jsonl (03_audit has not run): NO audit filter applied"),
        "settings": {"seed": hp.seed, "dataset_caps": hp.dataset_caps, "dataset_weights": hp.dataset_weights,
                     "weight_unit": hp.weight_unit, "datasets": _chosen(params),
                     "include_failed": hp.include_failed, "drop_truncated": hp.drop_truncated,
                     "dedupe": hp.dedupe, "max_context": max_context, "min_proof_level": hp.min_proof_level,
                     "train_turns": hp.train_turns},
        "datasets": c["datasets"],
        "weights": shares,
        **{k: c[k] for k in ("dropped_counts", "drop_reasons", "dropped")},
    }


def write_mix(mix: Mix, out_dir: Path) -> Path:
    """Write `mix.parquet` (a chunk of samples at a time) and `mix_manifest.json`, each atomically (safe when several
    workers write the same mix)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("position", pa.int64()), ("dataset", pa.string()), ("key", pa.string()),
                        ("sample_id", pa.string()), ("turn", pa.int32()), ("source", pa.string()),
                        ("ids_exact", pa.bool_()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.uint8()))])
    tag, path, at = tmp_tag(), out_dir / MIX_FILE, 0
    with atomic_path(path, tmp_suffix=tag) as tmp, pq.ParquetWriter(str(tmp), schema) as w:
        for ss in mix.iter_samples():
            w.write_table(pa.table([list(range(at, at + len(ss))), [s.dataset for s in ss], [str(s.key) for s in ss],
                                    [s.sample_id for s in ss], [s.turn for s in ss], [s.source for s in ss],
                                    [s.ids_exact for s in ss], [s.input_ids for s in ss], [s.loss_mask for s in ss]],
                                   schema=schema))
            at += len(ss)
    write_atomic(out_dir / MANIFEST_FILE, orjson.dumps(mix.manifest, option=orjson.OPT_INDENT_2), tmp_suffix=tag)
    return path


def read_mix(out_dir: str | Path, chunk: int = CHUNK) -> Mix:
    """A written mix: its keys and manifest now, its samples in mix order from `mix.parquet`, `chunk` at a time."""
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    path = out_dir / MIX_FILE
    if not path.exists():
        raise MixMissing(f"no training mix at {path}: run 04 first (eagle3data run PARAMS --only 04)")
    names = [c for c in ("dataset", "sample_id", "turn") if c in pq.read_schema(path).names]
    keys = SampleKey.of_frame(pq.read_table(path, columns=names).to_pydict())

    def chunks(n: int, keep_record: bool) -> Iterator[list[Sample]]:
        for b in pq.ParquetFile(path).iter_batches(batch_size=n):
            t = b.to_pydict()
            turns = t.get("turn") or [None] * len(t["dataset"])
            yield [Sample(d, sid, src, ex, None, ids, mask, turn=tn) for d, sid, tn, src, ex, ids, mask in
                   zip(t["dataset"], t["sample_id"], turns, t["source"], t["ids_exact"], t["input_ids"],
                       t["loss_mask"])]

    manifest = orjson.loads((out_dir / MANIFEST_FILE).read_bytes())
    return Mix(None, manifest, path, dropped=manifest.get("dropped", []), keys=keys, chunks=chunks, chunk=chunk)
