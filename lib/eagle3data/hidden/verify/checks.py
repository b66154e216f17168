"""The per-sample figures and verdicts of `verify-hidden` (`verify/run.py` streams the store through them).

Every figure is computed from one stored sample alone (read once); the verdicts compare it
with fixed limits measured on clean stores (docs/04 "Verify") and with the run's own samples
(median and MAD across samples), so a sample that differs from its run stands out.

The target's head (`Head`, `HeadBatch`, `head_figures`) is in `verify/head.py`.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any, Sequence

from eagle3data.core.errors import UserInputError
from eagle3data.core.params.hidden import Z_OUT_FLOOR, Z_PROMPT_FLOOR

# Limits measured on clean stores (docs/04 "Verify" gives the figures they come from).
# head_top1 (greedy records): a sample fails when its top-1 misses at K output positions are more than a clean
# sample gives with probability TOP1_ALPHA, for a clean miss rate of TOP1_CLEAN_MISS (above the worst measured).
TOP1_CLEAN_MISS = 0.03
TOP1_ALPHA = 1e-6
# Head positions (docs/04 "Head positions"): per sample at least Z_OUT_FLOOR output and Z_PROMPT_FLOOR prompt positions
# (core/params/hidden.py, beside the cap rule they set) scored by the logit z (`Head.logit_z`), more when
# HEAD_FLOPS_PER_BYTE x the sample's stored bytes buys more, at most the `positions` cap; over the run the same budget
# buys output positions through the whole head (top-1, log-prob; at least EXACT_RUN_FLOOR, `exact_plan`), judged pooled
# over the run (`run_head_problems`) and per sample from EXACT_PER_SAMPLE of them (head_logprob; head_top1 from the
# fewest that can fail, `top1_limit`).
EXACT_RUN_FLOOR = 8
EXACT_PER_SAMPLE = 16
HEAD_FLOPS_PER_BYTE = 10.0
DECODED_ROUNDING = 2.0 ** -8  # an 8-bit store decoded to bf16: each value rounded by at most 2^-9 of itself
REDUCE_BYTES = 2 * 2**20  # float32 bytes converted and reduced at once (within this CPU's 4 MiB L2; docs/04 "Cost")
MIN_OUT_LOGPROB = -4.0  # next output token log-prob: a sample's median (from EXACT_PER_SAMPLE), the run's pooled mean
# Logit z limits (mean over the sample's z positions; docs/04 "Thresholds"): per-sample means on the nbval fixture
# store, output 5.72-6.77 clean against 1.44-3.17 shifted or swapped; prompt (after the prefix another sample
# shares) 5.56-6.65 clean against 1.16-3.14 from another sample; at 64 positions no draw of 20,000 per sample crossed
# 4.5 on the embedded run's store either. Sampled records (temperature 1, the embedded run's prompts): clean output
# means 4.61-6.97, so their limit is MIN_SAMPLED_OUT_Z (the greedy broken ones reach 3.59); their log-prob is the
# sampler's (pooled mean -4.47 on that run), so only the run judges it.
MIN_OUT_Z = 4.5
MIN_PROMPT_Z = 4.5
MIN_SAMPLED_OUT_Z = 4.0
# The provider of records whose output is a dataset's own reply, never sampled by the target (06's `dataset_replies`):
# no sampler means no floor of its own; their output z is judged against the run alone, like a hot sampler's.
NOT_SAMPLED = "dataset_reply"
# The sampled floor is measured up to this temperature (clean means 4.61-6.97 at 1.0). Hotter samplers draw tokens the
# head ranks lower: at 1.3 the embedded run's clean means were 2.21-5.50, inside the broken ones' range, so above it
# only the run's own spread judges a sample's output z (its prompt z, the sampler's no part, keeps its floor).
SAMPLED_Z_MAX_TEMPERATURE = 1.0
Z_SPREAD_FLOOR = 0.5  # the least run spread (1.4826 MAD) a mean z is compared with
UNIT_RMS_TOL = 0.02  # a post-norm row: |rms(state / norm weight) - 1| below this
MIN_UNIT_SHARE_POST = 0.9  # share of rows that look post-norm in a state said to be post-norm
MAX_UNIT_SHARE_PRE = 0.1  # ... in a state said to be pre-norm
PROFILE_Z = 5.0  # robust z (median / 1.4826 MAD across the run's samples) that flags a norm-profile figure
PROFILE_FLOOR = {"log_rms": 0.1, "row0": 0.3}  # the least spread assumed (log units), so a tight run is not brittle
MIN_PROFILE_SAMPLES = 5  # fewer stored samples: the profile is not judged (said so in the summary)
# Recompute: an element is off when |stored - recomputed| > RTOL * |recomputed| + ATOL_SHARE * rms(recomputed row);
# a layer fails when more than MAX_OFF_SHARE of its elements are off, or any is off by GROSS x that (or NaN).
RECOMPUTE_RTOL = {"bfloat16": 2 ** -7, "float16": 2 ** -10, "float32": 1e-5}
RECOMPUTE_ATOL_SHARE = {"bfloat16": 2 ** -7, "float16": 2 ** -10, "float32": 1e-5}
# ... and at least this for the dtype the target computes in: a half-precision forward differs from itself with its
# batch's shape (04's padded batches against the recompute's one sequence). On the fixture store, 2026-12-03, of every
# element's |stored - fresh| / (|fresh| + rms(fresh row)): bf16 compute 99.99% within 0.082, the worst 0.27; fp16
# 0.0033 and 0.019; a same-length sample's states instead: 77% over 0.125.
COMPUTE_TOL = {"bfloat16": 2 ** -3, "float16": 2 ** -6, "float32": 0.0}
MAX_OFF_SHARE = 1e-3
GROSS = 16.0

CHECKS = {
    "finite": "no NaN or Inf in any stored state",
    "flat_rows": "no all-zero or constant row (one token's state of one layer)",
    "layer_duplicate": "no two stored layers equal element for element (8-bit stores: within their stored steps)",
    "final_kind": "the final state is the kind the store says (post-norm: rms(state / norm weight) = 1)",
    "head_top1": "greedy records: the head's top-1 is the record's next token at the exact output positions",
    "head_logprob": "the record's next output token is likely under the head (median log-prob; vs the run)",
    "head_logit_z": "the record's next output token's logit stands out of the vocabulary's (mean z; vs the run)",
    "prompt_logit_z": "the record's next prompt token's logit stands out of the vocabulary's (mean z; vs the run)",
    "shared_prefix": "where another sample shares a prefix of ids, the same states over it (norms; the head decides which)",
    "norm_profile": "per-layer RMS and first-token RMS within the run's own spread (median/MAD)",
    "shape": "states [n, S, hidden] in the store's dtype",
    "ids": "stored input_ids equal the source record's",
    "mask": "stored loss_mask equals the source record's",
    "mask_length": "as many ids and mask values as states",
    "source": "the sample is among the run's records",
    "recompute": "every stored layer equals a fresh forward of the target within the dtype's tolerance",
    "readable": "the file holding the sample opens (not truncated)",
    "checksum": "the file holding the sample has the content checksum 04 recorded when it wrote it",
}


class VerifyError(UserInputError):
    """`verify-hidden` cannot run on this input (no store, no checkpoint tensors); one line, exit 2."""


# ---------------------------------------------------------------------------- per-sample figures


def positions(key: str, candidates: list[int], k: int, first: bool = False) -> list[int]:
    """Up to `k` of `candidates` (all when k <= 0 or fewer), the same for the same key on every run;
    `first`: always the first candidate (the last prompt state, which predicts the first output token)."""
    if k <= 0 or len(candidates) <= k:
        return candidates
    import random

    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    if first:
        return [candidates[0]] + sorted(random.Random(seed).sample(candidates[1:], k - 1))
    return sorted(random.Random(seed).sample(candidates, k))


def unique_starts(ids: dict[Any, Sequence[int]]) -> dict[Any, int]:
    """Per sample: the length of the longest prefix of its ids that another sample shares (a system prompt, a
    template, the earlier turns of a conversation). The states there are the other sample's too, so they cannot
    tell the two apart: the prompt check draws its positions after it. Sorting the id strings puts the samples
    sharing the longest prefix next to each other."""
    import numpy as np

    arrs = {k: np.asarray(v, dtype=">i4") for k, v in ids.items()}
    order = sorted(arrs, key=lambda k: arrs[k].tobytes())

    def common(a: Any, b: Any) -> int:
        n = min(len(a), len(b))
        d = np.flatnonzero(a[:n] != b[:n])
        return int(d[0]) if len(d) else n

    out = dict.fromkeys(arrs, 0)
    for a, b in zip(order, order[1:]):
        c = common(arrs[a], arrs[b])
        out[a], out[b] = max(out[a], c), max(out[b], c)
    return out


def head_counts(n_bytes: int, hidden: int, cap: int) -> tuple[int, int]:
    """(output z, prompt z) head positions for a sample of `n_bytes` stored: the floors, raised by the budget
    (HEAD_FLOPS_PER_BYTE x the bytes read at 2 x hidden^2 FLOPs per position) up to `cap`; `cap` 0 = every position."""
    if cap <= 0:
        return 0, 0
    z = int(HEAD_FLOPS_PER_BYTE * n_bytes // (2.0 * hidden * hidden))
    return min(cap, max(Z_OUT_FLOOR, z)), min(cap, max(Z_PROMPT_FLOOR, z))


def exact_plan(lengths: Sequence[int], outputs: Sequence[int], token_bytes: int, hidden: int, vocab: int,
               cap: int) -> list[int]:
    """Whole-head (exact) output positions per sample, planned over the run before the pass: HEAD_FLOPS_PER_BYTE x
    the store's bytes at 2 x hidden x vocab FLOPs each, at least EXACT_RUN_FLOOR, shared in proportion to the
    samples' lengths (largest remainders), at most `cap` and the sample's output positions each; `cap` 0 = all."""
    room = [max(int(o), 0) for o in outputs]
    if cap <= 0:
        return room
    room = [min(cap, r) for r in room]
    total = int(HEAD_FLOPS_PER_BYTE * token_bytes * sum(lengths) // (2.0 * hidden * vocab))
    total = min(max(EXACT_RUN_FLOOR, total), sum(room))
    got = [0] * len(room)
    while total > sum(got):  # a few rounds: what a full sample cannot take goes to the others by length
        open_ = [i for i in range(len(room)) if got[i] < room[i]]
        left, weight = total - sum(got), sum(lengths[i] for i in open_)
        share = {i: left * lengths[i] / weight for i in open_}
        for i in open_:
            got[i] = min(room[i], got[i] + int(share[i]))
        for i in sorted(open_, key=lambda i: (int(share[i]) - share[i], -lengths[i], i)):
            if sum(got) >= total:
                break
            if got[i] < room[i]:
                got[i] += 1
    return got


def stored_rows(stored: dict[str, Any], codec: Any, a: int, n: int) -> dict[str, Any]:
    """Rows a..a+n of a run's tensors as stored (`HiddenReader.chunks(stored=True)`): the token-first ones sliced, the
    block's channel statistics whole (what `StateCodec.error_bound` reads)."""
    keep = set(codec.block_tensors())
    return {k: v if k in keep else v[a:a + n] for k, v in stored.items()}


def chunk_figures(hs: Any, names: Sequence[str], spans: Sequence[tuple[int, int]], codec: Any = None,
                  stored: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The figures that need no head, for each sample `(first row, rows)` of `spans` in the states `hs` [tokens, S,
    hidden] of consecutive samples: finiteness, flat rows, duplicate layers, norm profile.

    An 8-bit store (`codec` quantized, `stored` the same rows' tensors as stored, or decoded where no channels are
    stored) holds each layer within its own quantization step of what was captured, so two layers captured equal
    are stored equal only within their two steps: they are duplicates when every element agrees within
    `StateCodec.error_bound` of both (plus the decoded dtype's rounding), and the norm sums that pick the candidates
    widen by the bounds' row norms (`StateCodec.bound_norms`). A bf16 store's duplicates are equal element for element.

    One reduction per row (its 2-norm), over all the samples at once, and the row's first element decide every
    figure; the element-wise tests run only on the rows (or layer pairs) those cannot clear, so the verdicts are
    exact (NaN and Inf count as 0 in every figure but `nonfinite`). Returns the figures per span.
    """
    import numpy as np
    import torch

    t, s, h = hs.shape
    nrm, x0 = torch.empty(t, s), torch.empty(t, s)
    step = max(1, REDUCE_BYTES // (4 * s * h))  # rows per float32 block: converted and reduced while in cache
    buf = torch.empty(min(t, step), s, h)
    for a in range(0, t, step):  # converted, then reduced in float32 (docs/04 "Cost": reducing the stored bf16
        # directly with dtype=float32 was 4-5x slower; a second reduction, the row sum, cost 12% of the pass)
        x = buf[:min(step, t - a)]
        x.copy_(hs[a:a + step])
        torch.linalg.vector_norm(x, dim=-1, out=nrm[a:a + step])
        x0[a:a + step] = x[:, :, 0]
    owner = torch.full((t,), -1, dtype=torch.long)  # the span of each row
    for i, (a, n) in enumerate(spans):
        owner[a:a + n] = i
    nonfinite, flat = [0] * len(spans), [0] * len(spans)

    def per_span(rows: Any, counts: Any, into: list[int]) -> None:  # add per-row counts to their spans'
        for i, c in zip(owner[rows].tolist(), counts.tolist()):
            if i >= 0:
                into[i] += int(c)

    odd = ~torch.isfinite(nrm)  # a NaN/Inf element makes its row's norm non-finite
    if bool(odd.any()):
        rows = odd.any(1).nonzero()[:, 0]
        x = hs[rows].float()
        per_span(rows, (~torch.isfinite(x)).sum((1, 2)), nonfinite)
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        nrm[rows], x0[rows] = torch.linalg.vector_norm(x, dim=-1), x[:, :, 0]
    # a constant row c has norm |c| sqrt(h) and first element c; a row that is not within rounding of that is not flat
    maybe_flat = (x0.abs() * h ** 0.5 - nrm).abs() <= 1e-4 * nrm
    if bool(maybe_flat.any()):
        rows = maybe_flat.any(1).nonzero()[:, 0]
        cand = torch.nan_to_num(hs[rows].float(), nan=0.0, posinf=0.0, neginf=0.0)
        per_span(rows, ((cand.amax(-1) == cand.amin(-1)) & maybe_flat[rows]).sum(1), flat)
    # equal layers have equal row norms up to the reduction order's rounding, so equal sums of them over a span: each
    # span's sum per layer (float64 running sums), then every pair of layers; the spans that agree are compared exactly
    runs = torch.cat([torch.zeros(1, s, dtype=torch.float64), nrm.double().cumsum(0)])
    first = torch.tensor([a for a, _ in spans], dtype=torch.long)
    last = torch.tensor([a + n for a, n in spans], dtype=torch.long)
    tot = runs[last] - runs[first]  # [spans, S]
    la, lb = torch.triu_indices(s, s, 1)
    slack = 1e-4 * (tot[:, la] + tot[:, lb])
    quantized = codec is not None and codec.quantized
    if quantized:
        bn = torch.cat([torch.zeros(1, s, dtype=torch.float64), codec.bound_norms(stored, nrm).double().cumsum(0)])
        btot = bn[last] - bn[first]
        slack = slack + btot[:, la] + btot[:, lb] + DECODED_ROUNDING * (tot[:, la] + tot[:, lb])
    same = (tot[:, la] - tot[:, lb]).abs() <= slack
    dups: list[list[list[str]]] = [[] for _ in spans]
    pairs = list(zip(la.tolist(), lb.tolist()))
    for i, j in same.nonzero().tolist():  # (span, pair) whose norms agree
        a, n = spans[i]
        x, y = hs[a:a + n, pairs[j][0]], hs[a:a + n, pairs[j][1]]
        if quantized:
            e = codec.error_bound(stored_rows(stored, codec, a, n))
            x, y = x.float(), y.float()
            equal = bool(((x - y).abs() <= e[:, pairs[j][0]] + e[:, pairs[j][1]]
                          + DECODED_ROUNDING * (x.abs() + y.abs())).all())
        else:
            equal = torch.equal(x, y)
        if equal:
            dups[i].append([names[pairs[j][0]], names[pairs[j][1]]])
    rms = (nrm / h ** 0.5).numpy()
    out = []
    for i, (a, n) in enumerate(spans):
        rest = rms[a + 1:a + n] if n > 1 else rms[a:a + n]
        med = np.maximum(np.partition(rest, (len(rest) - 1) // 2, axis=0)[(len(rest) - 1) // 2], 1e-30).tolist()
        first_rms = np.maximum(rms[a], 1e-30).tolist()  # the lower median, as torch's median gives
        out.append({"nonfinite": nonfinite[i], "flat_rows": flat[i], "duplicate_layers": dups[i],
                    "log_rms": {names[j]: round(math.log(med[j]), 4) for j in range(s)},
                    "row0": {names[j]: round(math.log(first_rms[j] / med[j]), 4) for j in range(s)}})
    return out


# ---------------------------------------------------------------------------- verdicts


def _binom_tails(k: int, q: float) -> Any:
    """P(X >= m) for m = 0..k, X ~ Binomial(k, q), float64: log-space pmf (lgamma) and a reversed log-cumsum-exp,
    so a pooled run of 55,000 exact positions (13 TB of Kimi) neither overflows a float nor costs k^2."""
    import torch

    j = torch.arange(k + 1, dtype=torch.float64)
    if q <= 0.0 or q >= 1.0:
        return (j <= 0).double() if q <= 0.0 else torch.ones(k + 1, dtype=torch.float64)
    logpmf = (math.lgamma(k + 1) - torch.lgamma(j + 1) - torch.lgamma(k - j + 1)
              + j * math.log(q) + (k - j) * math.log1p(-q))
    return torch.logcumsumexp(logpmf.flip(0), 0).flip(0).exp().clamp(max=1.0)


def binom_tail(k: int, q: float, m: int) -> float:
    """P(X >= m) for X ~ Binomial(k, q)."""
    return 1.0 if m <= 0 else 0.0 if m > k else float(_binom_tails(k, q)[m])


@functools.lru_cache(maxsize=None)
def top1_limit(k: int) -> int:
    """The fewest top-1 misses of `k` output positions that fail a greedy sample: a clean sample (miss rate
    TOP1_CLEAN_MISS) reaches it with probability <= TOP1_ALPHA (k + 1, never, when k is too small for that)."""
    below = (_binom_tails(k, TOP1_CLEAN_MISS) <= TOP1_ALPHA).nonzero()
    return int(below[0]) if len(below) else k + 1


def robust_centre(values: list[float]) -> tuple[float, float]:
    """(median, 1.4826 x MAD) of the values: the centre and spread of the run's clean majority."""
    import statistics

    med = statistics.median(values)
    return med, 1.4826 * statistics.median(abs(v - med) for v in values)


def profile_stats(rows: list[dict[str, Any]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per profile figure and state name: the run's (median, spread) across the samples that have it."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for fig in ("log_rms", "row0"):
        by: dict[str, list[float]] = {}
        for r in rows:
            for nm, v in (r.get(fig) or {}).items():
                by.setdefault(nm, []).append(v)
        out[fig] = {nm: robust_centre(v) for nm, v in by.items()}
    for fig in ("out_logprob_median", "out_z_mean", "prompt_z_mean"):  # a log-prob median as judge takes it
        vals = [r[fig] for r in rows if r.get(fig) is not None and (
            fig != "out_logprob_median" or (r.get("out_exact_positions") or 0) >= EXACT_PER_SAMPLE)]
        if vals:
            out[fig] = {"": robust_centre(vals)}
    return out


def pooled_exact(rows: list[dict[str, Any]]) -> tuple[int, int, float | None]:
    """The greedy records' exact head positions pooled over the run: (positions, top-1 misses, mean log-prob).
    Sampled records are left out: a sampled token's log-prob is the sampler's, not the states'."""
    greedy = [r for r in rows if r.get("greedy") and r.get("out_exact_positions")]
    k = sum(r["out_exact_positions"] for r in greedy)
    miss = sum(r["out_misses"] for r in greedy)
    mean = sum(r["out_logprob_mean"] * r["out_exact_positions"] for r in greedy) / k if k else None
    return k, miss, mean


def run_head_problems(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The exact head positions pooled over the run (a store whose final states are not the target's fails here
    even where no sample has enough of them alone): the greedy records' top-1 misses against top1_limit of the
    pooled count, and their mean log-prob against MIN_OUT_LOGPROB. Problems as `{key: "*", check, detail}`."""
    out = []
    k, miss, mean = pooled_exact(rows)
    if k and miss >= top1_limit(k):
        out.append({"key": "*", "check": "head_top1",
                    "detail": f"the run's greedy records: {miss} top-1 misses of {k} exact output positions, at "
                              f"least {top1_limit(k)} fail (clean miss rate {TOP1_CLEAN_MISS:g})"})
    if mean is not None and mean < MIN_OUT_LOGPROB:
        out.append({"key": "*", "check": "head_logprob",
                    "detail": f"the run's greedy records: mean log-prob of the next output token {mean:.2f} at {k} "
                              f"exact positions, below {MIN_OUT_LOGPROB:g}"})
    return out


def out_z_floor(greedy: bool, temperature: float | None) -> float:
    """The least mean output z a sample may have on its own: MIN_OUT_Z greedy, MIN_SAMPLED_OUT_Z sampled at up to
    SAMPLED_Z_MAX_TEMPERATURE (or at a temperature not recorded), none hotter (the run's spread alone)."""
    if greedy:
        return MIN_OUT_Z
    return -math.inf if temperature is not None and temperature > SAMPLED_Z_MAX_TEMPERATURE else MIN_SAMPLED_OUT_Z


def judge(fig: dict[str, Any], stats: dict[str, Any], *, greedy: bool, judge_profile: bool,
          temperature: float | None = None) -> tuple[list[str], dict[str, Any]]:
    """The checks one sample fails (names of `CHECKS`) and the z-scores behind the run-relative ones (`temperature`:
    the record's sampler's, which sets its output z floor: `out_z_floor`)."""
    failed: list[str] = []
    z: dict[str, Any] = {}
    if fig["nonfinite"]:
        failed.append("finite")
    if fig["flat_rows"]:
        failed.append("flat_rows")
    if fig["duplicate_layers"]:
        failed.append("layer_duplicate")
    share = fig.get("unit_rms_share") or {}
    if any((v < MIN_UNIT_SHARE_POST) if nm == "post_norm" else (v > MAX_UNIT_SHARE_PRE) for nm, v in share.items()):
        failed.append("final_kind")
    if greedy and fig.get("out_exact_positions") and fig["out_misses"] >= top1_limit(fig["out_exact_positions"]):
        failed.append("head_top1")
    if (fig.get("out_exact_positions") or 0) < EXACT_PER_SAMPLE:
        fig = {k: v for k, v in fig.items() if k != "out_logprob_median"}  # too few to judge one sample: pooled only
    for figname, check, floor, spread_floor in (("out_logprob_median", "head_logprob",
                                                 MIN_OUT_LOGPROB if greedy else -math.inf, 0.5),
                                                ("out_z_mean", "head_logit_z", out_z_floor(greedy, temperature),
                                                 Z_SPREAD_FLOOR),
                                                ("prompt_z_mean", "prompt_logit_z", MIN_PROMPT_Z, Z_SPREAD_FLOOR)):
        v = fig.get(figname)
        if v is None:
            continue
        low = v < floor
        if judge_profile and figname in stats:
            med, spread = stats[figname][""]
            z[figname] = round((v - med) / max(spread, spread_floor), 2)
            low = low or z[figname] < -PROFILE_Z
        if low:
            failed.append(check)
    if judge_profile:
        worst = 0.0
        for figname in ("log_rms", "row0"):
            for nm, v in (fig.get(figname) or {}).items():
                med, spread = stats[figname][nm]
                zz = (v - med) / max(spread, PROFILE_FLOOR[figname])
                if abs(zz) > abs(worst):
                    worst = zz
                    z["norm_profile_worst"] = {"figure": figname, "state": nm, "z": round(zz, 2)}
        if abs(worst) > PROFILE_Z:
            failed.append("norm_profile")
    return failed, z


# ---------------------------------------------------------------------------- recompute


def compare_states(stored: Any, ref: Any, names: Sequence[str], dtype: str, bound: Any = None,
                   compute: str = "float32") -> dict[str, Any]:
    """Per stored layer: the share of elements beyond the tolerance of a fresh forward, and the worst. The tolerance
    is the store's `dtype`'s, or the `compute` dtype's (the target's forward, `COMPUTE_TOL`) where that is looser;
    `bound`: an 8-bit store's own error per element (`StateCodec.error_bound`), added to it."""
    s, r = stored.float(), ref.float()
    floor = COMPUTE_TOL.get(compute, COMPUTE_TOL["bfloat16"])
    rtol, atol = max(RECOMPUTE_RTOL.get(dtype, 1e-2), floor), max(RECOMPUTE_ATOL_SHARE.get(dtype, 1e-2), floor)
    out: dict[str, Any] = {}
    for i, nm in enumerate(names):
        a, b = s[:, i], r[:, i]
        row = b.pow(2).mean(-1, keepdim=True).sqrt()
        err = (a - b).abs()
        tol = rtol * b.abs() + atol * row + (0.0 if bound is None else bound[:, i])
        off = ~(err <= tol)  # NaN counts as off
        out[nm] = {"off_share": round(float(off.float().mean()), 6), "gross": int((~(err <= GROSS * tol)).sum()),
                   "max_rel": round(float((err / (row + 1e-30)).nan_to_num(float("inf")).max()), 6)}
    return out


def recompute_failed(cmp: dict[str, Any]) -> bool:
    """A layer has more than MAX_OFF_SHARE of its elements off, or one grossly off."""
    return any(v["off_share"] > MAX_OFF_SHARE or v["gross"] for v in cmp.values())
