"""`eagle3data verify-hidden`: prove that the stored states are the target's own (docs/04 "Verify").

One streamed pass over the store (through `HiddenReader`, each shard read once) computes the
figures of every sample (`checks.chunk_figures`, many samples' states reduced at once:
finiteness, flat rows, duplicate layers, the norm profile; `head.head_figures`: the final state's kind,
the target's head at sampled positions, batched across samples) and
the store checks that 04's validation has always made (shape, ids, mask, coverage); samples
picked for recompute are run through the target again by a recompute backend and compared
layer by layer. The verdicts come after the pass, once the run's own spread is known.

Writes `hidden/verify.jsonl` (one line per stored sample: `key`, `failed`, the figures) and
`hidden/verify_summary.json` (per check: applicable, failed, the 95% upper bound), and records
the outcome in `hidden/index.json` (`verification`), which 05 reads before it exports.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import orjson

from eagle3data.core.models import resolve_model_path
from eagle3data.core.params import RunParams
from eagle3data.core.params.hidden import Z_PROMPT_FLOOR, positions_problem
from eagle3data.core.reader import SampleKey, read_run
from eagle3data.core.stats import upper95, upper95_text
from eagle3data.generate.backends.vllm_server import server_dtype
from eagle3data.hidden.mix import _chosen, hidden_dir, read_mix
from eagle3data.hidden.store.format import HiddenError, _torch_dtype, stored_bytes_per_token
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.store.validation import sample_problems
from eagle3data.hidden.verify.checks import (CHECKS, EXACT_PER_SAMPLE, MIN_PROFILE_SAMPLES, NOT_SAMPLED,
                                             SAMPLED_Z_MAX_TEMPERATURE,
                                             VerifyError, chunk_figures, compare_states, exact_plan, head_counts, judge,
                                             out_z_floor, pooled_exact, profile_stats, recompute_failed,
                                             run_head_problems, stored_rows, top1_limit,
                                             unique_starts)
from eagle3data.hidden.verify.head import HeadBatch, head_figures, load_head
from eagle3data.hidden.verify.prefix import (PREFIX_NORM_TOL, compare_pairs, judge_pairs, kept_rows, prefix_pairs,
                                             row_norms)
from eagle3data.hidden.verify.record import _record_in_index, _write

VERIFY_FILE = "verify.jsonl"
SUMMARY_FILE = "verify_summary.json"
RECOMPUTE_GROUP = 256  # per-sample layouts: "a shard" for the default recompute is this many samples
DEFAULT_RECOMPUTE = 2  # samples recomputed per shard by default
CHUNK_BYTES = 64 * 2**20  # stored bytes of consecutive samples whose figures are reduced at once (float32: twice)
DEFAULT_POSITIONS = 64  # the most head positions per sample (exact, output z, prompt z each) by default; floors and
# budget (checks: EXACT_RUN_FLOOR, HEAD_FLOPS_PER_BYTE; core/params/hidden: Z_OUT_FLOOR, Z_PROMPT_FLOOR) choose how
# many below it

# A recompute backend: what `capture.Capture` is: `run(input_ids [1, n]) -> states [1, n, S, hidden]` in the
# store's order and dtype, and `close()`. `verify_store` takes a factory of one, called only when a sample is picked.
# One that cannot answer a sample at a time (SGLang's two passes, `verify/sglang.py`) also has `prepare(id lists)`:
# given every picked sample's stored ids before the pass, it computes them all; `run` then serves them.
Backend = Callable[[], Any]


def recompute_picks(reader: HiddenReader, per_shard: int | str) -> set[str]:
    """Keys to recompute: `all`, or `per_shard` per shard (per RECOMPUTE_GROUP samples in per-sample layouts),
    the same on every run (smallest hash of the key)."""
    keys = reader.keys()
    if per_shard == "all":
        return set(keys)
    k = int(per_shard)
    if k <= 0:
        return set()
    groups: dict[Any, list[str]] = {}
    for i, key in enumerate(keys):
        g = reader.index.iloc[i]["shard"] if reader.layout == "shards" else i // RECOMPUTE_GROUP
        groups.setdefault(g, []).append(key)
    h = lambda s: hashlib.blake2b(s.encode(), digest_size=8).digest()  # noqa: E731
    return {key for ks in groups.values() for key in sorted(ks, key=h)[:k]}


@dataclass
class VerifyResult:
    """What `verify_store` found: a line per sample, the per-check counts, where they were written."""

    hidden_dir: Path
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    lines_path: Path
    store_problems: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.summary["ok"])

    def table(self):
        """Per check: what it proves, applicable samples, failed, and the 95% upper bound on its failure rate."""
        import pandas as pd

        rows = [{"check": name, "applicable": c["applicable"], "failed": c["failed"], "upper95": upper95_text(c),
                 "what": c["what"]} for name, c in self.summary["checks"].items()]
        return pd.DataFrame(rows).set_index("check")

    def failed_table(self):
        """The samples that failed something, with the check names."""
        import pandas as pd

        bad = [{"key": r["key"], "failed": ", ".join(r["failed"])} for r in self.rows if r["failed"]]
        bad += [{"key": p["key"], "failed": f"{p['check']}: {p['detail']}"} for p in self.store_problems]
        return pd.DataFrame(bad, columns=["key", "failed"])

    def line(self) -> str:
        s = self.summary
        failed = {k: v["failed"] for k, v in s["checks"].items() if v["failed"]}
        return (f"verify-hidden: {s['samples']} samples, {s['failed_samples']} failed"
                + (f" ({', '.join(f'{k} {v}' for k, v in failed.items())})" if failed else "")
                + f"; recomputed {s['recomputed']}; logit z at {s['head']['out_mean']:g} output + "
                  f"{s['head']['prompt_mean']:g} prompt positions per sample (at most {s['positions']}), the whole "
                  f"head at {s['head']['exact_positions']} output positions over the run"
                + (f"; the output z of {s['out_z_run_only']} samples sampled hotter than temperature "
                   f"{SAMPLED_Z_MAX_TEMPERATURE:g} (or not by the target) judged against the run alone"
                   if s.get("out_z_run_only") else "")
                + ("" if s.get("checksummed", True) else "; not checksummed (a store written before checksums)")
                + f" -> {self.lines_path.parent.name}/{self.lines_path.name}")


def compute_dtype(params: RunParams) -> str:
    """The dtype the target computes its states in, for the recompute's tolerance: the HF model's (`model.dtype`),
    or the vLLM or SGLang server's (`hidden.vllm.server.dtype`, `hidden.sglang.server.dtype`, else `model.dtype`;
    `auto`, the checkpoint's: taken as bf16)."""
    hp = params.hidden
    engine = {"vllm": hp.vllm, "sglang": hp.sglang}.get(hp.backend)
    d = server_dtype(params, engine) if engine is not None else params.model.dtype
    return "bfloat16" if d == "auto" else d


def _sampling(view: Any, datasets: Sequence[str]) -> tuple[set[str], dict[str, float]]:
    """Keys of records sampled greedily (temperature 0) with exact ids (their head top-1 is checked), and each
    record's sampling temperature where it says one (its output z floor: `checks.out_z_floor`); a dataset's own
    reply (provider `NOT_SAMPLED`, 06's `dataset_replies`) was never the target's sample: judged by the run alone."""
    greedy, temps = set(), {}
    for r in view.records(datasets):
        if r.get("provider") == NOT_SAMPLED:  # a dataset's own reply: no sampler of the target's, no floor of its own
            temps[str(SampleKey.of(r))] = math.inf
            continue
        t = (r.get("sampling") or {}).get("temperature")
        if t is not None:
            temps[str(SampleKey.of(r))] = float(t)
            if float(t) == 0.0 and r.get("ids_exact"):
                greedy.add(str(SampleKey.of(r)))
    return greedy, temps


def verify_store(params: RunParams, *, config: Any, backend: Backend | None = None,
                 recompute: int | str = DEFAULT_RECOMPUTE, positions: int = DEFAULT_POSITIONS,
                 out: str | Path | None = None) -> VerifyResult:
    """Verify every stored sample of a run (one streamed pass); write the lines, the summary, index.json's entry.

    `config`: the target's config (norm eps, tied head); `backend`: makes the recompute backend (see
    `Backend`), needed when `recompute` (samples per shard run through the target again; `all`; 0
    for none) picks any; `positions`: the most output and prompt positions per sample given to the head (each;
    0 = all); below it `checks.head_counts` picks the count (floors for the checks' power, a budget per byte).
    """
    if why := positions_problem(positions):
        raise VerifyError(f"verify-hidden positions {positions}: {why}")
    t0 = time.perf_counter()
    hdir = hidden_dir(params)
    reader = HiddenReader(hdir)
    reader.prefetch()  # the store's first files come from disk while the records, the mix and the head are read
    info = reader.info
    names = reader.states
    dtype = _torch_dtype(info["dtype"])
    mix = read_mix(hdir)
    datasets = _chosen(params)
    view = read_run(params.run_dir, datasets, verdicts=False)
    sources = view.samples(datasets)
    greedy, temps = _sampling(view, datasets)
    shared = unique_starts({k: s.input_ids for k, s in sources.items()})
    pairs = prefix_pairs({str(k): s.input_ids for k, s in sources.items() if reader.row(k) is not None})
    kept, norms = kept_rows(pairs), {}  # a few rows of each shared prefix: their norms, kept through the pass
    head = load_head(resolve_model_path(params.model.path), config)
    head.moments()  # the vocabulary's logit moments, once (a hidden^2 x vocab GEMM), before the pass
    picks = recompute_picks(reader, recompute)
    compute = compute_dtype(params)
    redo = None
    if picks:
        if backend is None:
            raise VerifyError(f"{len(picks)} samples picked for recompute, but no recompute backend was given")
        redo = backend()
    setup_s = time.perf_counter() - t0  # the records, the mix, the head's tensors and moments: once
    recompute_s = 0.0
    if redo is not None and hasattr(redo, "prepare"):  # every picked sample's stored ids, at once (see `Backend`)
        t1 = time.perf_counter()
        try:
            redo.prepare(_picked_ids(reader, picks))
        except BaseException:
            redo.close()
            raise
        recompute_s = time.perf_counter() - t1
    rows: list[dict[str, Any]] = []
    store_problems: list[dict[str, Any]] = []
    batch = HeadBatch(head)
    token_bytes = stored_bytes_per_token(info)
    vocab, hidden = (int(d) for d in head.lm_head.shape)
    ix = reader.index
    outputs = ix["loss_tokens"].tolist() if "loss_tokens" in ix else ix["length"].tolist()
    exact = dict(zip(reader.keys(), exact_plan(ix["length"].tolist(), outputs, token_bytes, hidden, vocab, positions)))
    shape = (len(names), info["hidden_size"])
    files: dict[str, dict[str, str]] = {}  # a file that does not open, or whose checksum is not the index's
    try:
        for chunk, part in reader.chunks(CHUNK_BYTES, problems=files, checksums=True, stored=reader.codec.quantized):
            hs_all, ids_all, mask_all = part["hidden_states"], part["input_ids"], part["loss_mask"]
            todo = []  # (row, sample) of the samples whose states have the store's shape: their figures at once
            for r in chunk:
                a, n = r["at"], int(r["length"])
                smp = {"length": n, "hidden_states": hs_all[a:a + n], "input_ids": ids_all[a:a + n],
                       "loss_mask": mask_all[a:a + n]}
                skey = SampleKey.of(r)
                key = str(skey)
                row: dict[str, Any] = {"key": key, "position": int(r["position"]), "length": n, "greedy": key in greedy}
                probs = sample_problems(smp, sources.get(skey), shape, dtype, finite=False)
                row["store"] = [c for c, _ in probs]
                if "shape" not in row["store"]:
                    row["shared_prefix"] = shared.get(skey, 0)
                    todo.append((row, smp, a, len(rows)))
                    if key in kept:
                        norms[key] = row_norms(smp["hidden_states"], kept[key])
                rows.append(row)
            if not todo:
                continue
            figs = chunk_figures(hs_all, names, [(a, row["length"]) for row, _, a, _ in todo], reader.codec,
                                 part.get("stored"))
            plan = [{"at": a, "length": row["length"], "key": row["key"], "tag": tag, "prompt_from": row["shared_prefix"],
                     "k": (exact[row["key"]], *head_counts(row["length"] * token_bytes, hidden, positions))}
                    for row, _, a, tag in todo]
            heads = head_figures(hs_all, ids_all, mask_all, names, head, plan, batch,
                                 finite=not any(f["nonfinite"] for f in figs))
            for (row, smp, a, tag), fig, hfig in zip(todo, figs, heads):
                row.update(fig)
                row.update(hfig)
                row["_tag"] = tag
                if row["key"] in picks:
                    t1 = time.perf_counter()
                    ref = redo.run(smp["input_ids"].long()[None])[0].cpu()
                    bound = (reader.codec.error_bound(stored_rows(part["stored"], reader.codec, a, row["length"]))
                             if reader.codec.quantized else None)  # an 8-bit store differs by its own step too
                    row["recompute"] = compare_states(smp["hidden_states"], ref, names, info["dtype"], bound, compute)
                    recompute_s += time.perf_counter() - t1
        batch.flush()
    finally:
        if redo is not None:
            redo.close()
    for r in rows:
        if "_tag" in r:
            tag = r.pop("_tag")
            r.update(batch.figures((tag, "out"), "out") | batch.figures((tag, "prompt"), "prompt"))
    _file_rows(rows, files, reader, greedy)
    if len(rows) != len(mix.samples) or reader.keys() != [str(s.key) for s in mix.samples]:
        store_problems.append({"key": "*", "check": "coverage",
                               "detail": f"{len(rows)} stored samples, {len(mix.samples)} in the mix: the index "
                                         "must hold exactly the mix's keys in mix order"})
    rows.sort(key=lambda r: r["position"])  # the reader goes shard by shard; the lines follow the mix order
    _shared_prefixes(rows, pairs, kept, norms, reader, head, compute)
    store_problems += run_head_problems(rows)
    judged = [r for r in rows if "log_rms" in r]
    stats = profile_stats(judged)
    with_profile = len(judged) >= MIN_PROFILE_SAMPLES
    run_only = 0  # samples whose output z has no floor of its own (sampled hotter than it was measured at)
    for r in rows:
        failed = [c for c in r.pop("store") if c != "finite"]  # NaN is judged below, from the figures
        if "log_rms" in r:
            t = temps.get(r["key"])
            run_only += out_z_floor(r["greedy"], t) == -math.inf
            more, z = judge(r, stats, greedy=r["greedy"], judge_profile=with_profile, temperature=t)
            failed += more
            r["z"] = z
            if "recompute" in r and recompute_failed(r["recompute"]):
                failed.append("recompute")
        if r.get("prefix_failed"):
            failed.append("shared_prefix")
        r["failed"] = sorted(set(failed))
    summary = _summary(rows, store_problems, info, picks, positions, with_profile, stats)
    summary["out_z_run_only"] = run_only
    summary["checksummed"] = reader.checksummed  # False: a store written before checksums ("not checksummed")
    summary["file_problems"] = {f: list(v.values()) for f, v in sorted(files.items())}
    summary["compute_dtype"] = compute  # the target's forward: its dtype sets the recompute's tolerance floor
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    summary["recompute_seconds"] = round(recompute_s, 3)
    summary["setup_seconds"] = round(setup_s, 3)
    summary["head_seconds"] = round(batch.seconds, 3)
    lines = Path(out) if out else hdir / VERIFY_FILE
    summary["lines"] = str(lines)
    _write(lines, b"".join(orjson.dumps(_line(r)) + b"\n" for r in rows))
    _write(hdir / SUMMARY_FILE, orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    _record_in_index(hdir, summary)
    return VerifyResult(hdir, rows, summary, lines, store_problems)


def _picked_ids(reader: HiddenReader, picks: set[str]) -> list[list[int]]:
    """The stored input ids of the picked samples, in store order (a file that does not read gives none: its samples
    fail `readable` in the pass and are never recomputed)."""
    out = []
    for i, key in enumerate(reader.keys()):
        if key in picks:
            try:
                out.append(reader.stored_ids(i)[0])
            except HiddenError:
                continue
    return out


def _file_rows(rows: list[dict[str, Any]], files: dict[str, dict[str, str]], reader: HiddenReader,
               greedy: set[str]) -> None:
    """The samples of each file with a problem fail its checks (`readable`, `checksum`) by name; a file that did not
    open gave no rows, so its samples get theirs here (no figures)."""
    by_key = {r["key"]: r for r in rows}
    for file, probs in files.items():
        for key in reader.file_keys(file):
            r = by_key.get(key)
            if r is None:
                i = reader.row(key)
                r = {"key": key, "position": int(reader.index.iloc[i]["position"]),
                     "length": int(reader.index.iloc[i]["length"]), "greedy": key in greedy, "store": []}
                rows.append(r)
            r["store"] = r["store"] + list(probs)
            r["file_problem"] = " | ".join(probs.values())


def _shared_prefixes(rows: list[dict[str, Any]], pairs: Any, kept: dict[str, list[int]], norms: dict[str, Any],
                     reader: HiddenReader, head: Any, compute: str) -> None:
    """The shared-prefix check (`prefix`): each pair's kept norms compared; where rows differ, the head decides which
    sample differs (its states re-read at those rows). Adds `prefix_rows`, `prefix_differ`, `prefix_max_rel` and, where
    the head judged, `prefix_z` and `prefix_failed` to the rows."""
    compared = compare_pairs(pairs, kept, norms, PREFIX_NORM_TOL.get(compute, PREFIX_NORM_TOL["bfloat16"]))

    def read(key: str) -> tuple[Any, Any]:
        smp = reader.sample(key)
        return smp["hidden_states"], smp["input_ids"].long()

    judged = judge_pairs(compared, read, head, reader.states, Z_PROMPT_FLOOR)
    by_key = {r["key"]: r for r in rows}
    for (a, b), cmp in compared.items():
        for k in (a, b):
            r = by_key[k]
            r["prefix_rows"] = r.get("prefix_rows", 0) + len(cmp["rows"])
            r["prefix_differ"] = r.get("prefix_differ", 0) + len(cmp["differ"])
            r["prefix_max_rel"] = round(max(r.get("prefix_max_rel", 0.0), cmp["max_rel"]), 6)
    for k, got in judged.items():
        by_key[k]["prefix_z"] = got["against"]
        by_key[k]["prefix_failed"] = got["failed"]


def _line(r: dict[str, Any]) -> dict[str, Any]:
    return {"key": r["key"], "failed": r["failed"], **{k: v for k, v in r.items() if k not in ("key", "failed")}}


def _summary(rows: list[dict[str, Any]], store_problems: list[dict[str, Any]], info: dict[str, Any],
             picks: set[str], positions: int, with_profile: bool, stats: dict[str, Any]) -> dict[str, Any]:
    n = len(rows)
    judged = sum(1 for r in rows if "log_rms" in r)
    applicable = {c: n for c in ("shape", "ids", "mask", "mask_length", "source", "readable")}
    applicable["checksum"] = n if info.get("checksum") else 0
    applicable |= {c: judged for c in ("finite", "flat_rows", "layer_duplicate", "final_kind")}
    applicable["head_logprob"] = sum(1 for r in rows if (r.get("out_exact_positions") or 0) >= EXACT_PER_SAMPLE)
    applicable["head_logit_z"] = sum(1 for r in rows if r.get("out_positions"))
    applicable["prompt_logit_z"] = sum(1 for r in rows if r.get("prompt_positions"))
    applicable["shared_prefix"] = sum(1 for r in rows if r.get("prefix_rows"))
    applicable["head_top1"] = sum(1 for r in rows if r.get("greedy") and r.get("out_exact_positions")
                                  and top1_limit(r["out_exact_positions"]) <= r["out_exact_positions"])
    applicable["norm_profile"] = judged if with_profile else 0
    applicable["recompute"] = sum(1 for r in rows if "recompute" in r)
    checks = {}
    for c, what in CHECKS.items():
        a = applicable.get(c, 0)
        f = sum(1 for r in rows if c in r["failed"])
        checks[c] = {"applicable": a, "failed": f, "upper95": None if a == 0 else round(upper95(f, a), 6),
                     "what": what}
    pooled = int(pooled_exact(rows)[0] > 0)  # the run checks apply when greedy records have exact positions
    for c, what in (("run_head_top1", "the run's greedy records: top-1 at the exact output positions, pooled"),
                    ("run_head_logprob", "the run's greedy records: mean log-prob of the next output token, pooled")):
        checks[c] = {"applicable": pooled, "upper95": None, "what": what,
                     "failed": sum(1 for p in store_problems if p["check"] == c[len("run_"):])}
    checks["coverage"] = {"applicable": 1, "failed": sum(1 for p in store_problems if p["check"] == "coverage"),
                          "upper95": None,
                          "what": "the index holds exactly the mix's keys in mix order"}
    failed_samples = sum(1 for r in rows if r["failed"])
    return {"ok": failed_samples == 0 and not store_problems, "samples": n, "failed_samples": failed_samples,
            "tokens": sum(r["length"] for r in rows), "states": list(info.get("states") or []),
            "final_state": info.get("final_state"), "layout": info.get("layout", "shards"), "dtype": info["dtype"],
            "positions": positions or "all", "head": _head_use(rows), "recomputed": len(picks & {r["key"] for r in rows}),
            "norm_profile": ("judged" if with_profile else f"not judged: fewer than {MIN_PROFILE_SAMPLES} samples"),
            "run_centre": {k: {nm: [round(m, 4), round(s, 4)] for nm, (m, s) in v.items()} for k, v in stats.items()},
            "checks": checks, "store_problems": store_problems, "verified_at": time.time()}


def _head_use(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How many head positions the pass used: in all, and per sample (exact output, z output, z prompt)."""
    got = [r for r in rows if "log_rms" in r]
    k = max(len(got), 1)
    exact, out, prompt = ([r.get(f, 0) for r in got] for f in ("out_exact_positions", "out_positions", "prompt_positions"))
    gk, gmiss, glp = pooled_exact(got)  # the greedy records' (a sampled token's log-prob is the sampler's)
    return {"positions": sum(out) + sum(prompt), "exact_positions": sum(exact), "exact_mean": round(sum(exact) / k, 1),
            "out_mean": round(sum(out) / k, 1), "prompt_mean": round(sum(prompt) / k, 1),
            "pooled_greedy_top1": round(1 - gmiss / gk, 4) if gk else None,
            "pooled_greedy_logprob_mean": round(glp, 4) if glp is not None else None}
