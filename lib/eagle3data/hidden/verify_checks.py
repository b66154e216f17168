"""The per-sample figures and verdicts of `verify-hidden` (`verify.py` streams the store through them).

Every figure is computed from one stored sample alone (read once); the verdicts compare it
with fixed limits measured on clean stores (docs/04 "Verify") and with the run's own samples
(median and MAD across samples), so a sample that differs from its run stands out.

The target's head is read from the checkpoint alone: the final norm's weight and `lm_head`
(or the tied input embedding), a few tensors of the safetensors files, never the model.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import orjson

from eagle3data.core.errors import UserInputError
from eagle3data.core.models import cache_dir
from eagle3data.hidden.norms import known_norm_kind

# Limits measured on clean stores (docs/04 "Verify" gives the figures they come from).
# head_top1 (greedy records): a sample fails when its top-1 misses at K output positions are more than a clean
# sample gives with probability TOP1_ALPHA, for a clean miss rate of TOP1_CLEAN_MISS (above the worst measured).
TOP1_CLEAN_MISS = 0.03
TOP1_ALPHA = 1e-6
# Head positions (docs/04 "Head positions"): per sample at least Z_OUT_FLOOR output and Z_PROMPT_FLOOR prompt positions
# scored by the logit z (`Head.logit_z`), more when HEAD_FLOPS_PER_BYTE x the sample's stored bytes buys more, at most
# the `positions` cap; over the run the same budget buys output positions through the whole head (top-1, log-prob;
# at least EXACT_RUN_FLOOR, `exact_plan`), judged pooled over the run (`run_head_problems`) and per sample from
# EXACT_PER_SAMPLE of them (head_logprob; head_top1 from the fewest that can fail, `top1_limit`).
EXACT_RUN_FLOOR = 8
EXACT_PER_SAMPLE = 16
Z_OUT_FLOOR = 64
Z_PROMPT_FLOOR = 64
HEAD_FLOPS_PER_BYTE = 10.0
HEAD_BATCH = 512  # positions per head GEMM, across samples
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
MAX_OFF_SHARE = 1e-3
GROSS = 16.0

CHECKS = {
    "finite": "no NaN or Inf in any stored state",
    "flat_rows": "no all-zero or constant row (one token's state of one layer)",
    "layer_duplicate": "no two stored layers equal element for element",
    "final_kind": "the final state is the kind the store says (post-norm: rms(state / norm weight) = 1)",
    "head_top1": "greedy records: the head's top-1 is the record's next token at the exact output positions",
    "head_logprob": "the record's next output token is likely under the head (median log-prob; vs the run)",
    "head_logit_z": "the record's next output token's logit stands out of the vocabulary's (mean z; vs the run)",
    "prompt_logit_z": "the record's next prompt token's logit stands out of the vocabulary's (mean z; vs the run)",
    "norm_profile": "per-layer RMS and first-token RMS within the run's own spread (median/MAD)",
    "shape": "states [n, S, hidden] in the store's dtype",
    "ids": "stored input_ids equal the source record's",
    "mask": "stored loss_mask equals the source record's",
    "mask_length": "as many ids and mask values as states",
    "source": "the sample is among the run's records",
    "recompute": "every stored layer equals a fresh forward of the target within the dtype's tolerance",
}


class VerifyError(UserInputError):
    """`verify-hidden` cannot run on this input (no store, no checkpoint tensors); one line, exit 2."""


# ---------------------------------------------------------------------------- the head


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (through `model.safetensors.index.json` when sharded)."""
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        return {k: folder / v for k, v in orjson.loads(idx.read_bytes())["weight_map"].items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def _pick(names: Sequence[str], suffix: str, exclude: str = "layers.") -> str | None:
    got = sorted((n for n in names if n.endswith(suffix) and exclude not in n), key=len)
    return got[0] if got else None


@dataclass
class Head:
    """The target's final norm (RMSNorm: weight, eps) and LM head `[vocab, hidden]`, in float32."""

    norm_weight: Any
    lm_head: Any
    eps: float
    tensors: tuple[str, ...]
    origin: str = ""  # the head tensor's file, size and mtime: names its moments in the cache
    _moments: Any = field(default=None, repr=False)
    _factor16: Any = field(default=None, repr=False)

    def norm(self, x: Any) -> Any:
        """The final RMSNorm of pre-norm states `[..., hidden]` (float32)."""
        import torch

        x = x.float()
        return self.norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def moments(self) -> tuple[Any, Any]:
        """(mean row `[hidden]`, a factor F `[hidden, hidden]` of the rows' covariance, F F^T = cov): for any state x
        the vocabulary's mean logit is x . mean and the variance of its logits is |x F|^2, exactly. Computed once per
        checkpoint (float64 sums of a hidden^2 x vocab GEMM, then eigh) and kept in the model cache (`moments_path`)."""
        if self._moments is None:
            from safetensors.torch import load_file, save_file

            path = moments_path(self.origin) if self.origin else None
            if path is not None and path.exists():
                got = load_file(str(path))
                self._moments = (got["mean"], got["factor"])
            else:
                self._moments = self._compute_moments()
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(f".{os.getpid()}.tmp")
                    save_file({"mean": self._moments[0], "factor": self._moments[1]}, str(tmp))
                    os.replace(tmp, path)
        return self._moments

    def _compute_moments(self) -> tuple[Any, Any]:
        import torch

        w = self.lm_head
        mean = w.sum(0, dtype=torch.float64) / w.shape[0]
        cov = torch.zeros(w.shape[1], w.shape[1], dtype=torch.float64)
        m32 = mean.float()
        for a in range(0, w.shape[0], 16384):  # centred in float32 chunks, summed in float64
            c = w[a:a + 16384] - m32
            cov += (c.T @ c).double()
        cov /= w.shape[0]
        vals, vecs = torch.linalg.eigh(cov)  # cov = V diag(vals) V^T, so x^T cov x = |x V sqrt(vals)|^2
        return m32.contiguous(), (vecs * vals.clamp_min(0).sqrt()).float().contiguous()

    def logit_z(self, post: Any, targets: Any) -> Any:
        """Per row: (logit of the target - the vocabulary's mean logit) / the std of the vocabulary's logits, for
        post-norm states `[k, hidden]`; 2 x hidden^2 FLOPs per row instead of the whole head's 2 x hidden x vocab.
        By Cantelli's inequality at most a share 1 / (1 + z^2) of the vocabulary scores at least the target.
        The std's GEMM runs in bfloat16 (2.2-2.6x faster on this CPU, docs/04 "Cost"; its row norms are within
        0.1% of float32's); the target's and the mean logit are float32."""
        import torch

        mean, factor = self.moments()
        if self._factor16 is None:
            self._factor16 = factor.to(torch.bfloat16)
        x = post.float()
        sd = torch.linalg.vector_norm((x.to(torch.bfloat16) @ self._factor16).float(), dim=-1).clamp_min(1e-30)
        return ((x * self.lm_head[targets.long()]).sum(-1) - x @ mean) / sd

    def unit_rms(self, x: Any) -> Any:
        """rms(state / norm weight) per row over the channels whose weight is not ~0: 1 for a post-norm state."""
        import torch

        if getattr(self, "_inv", None) is None:
            keep = self.norm_weight.abs() > 1e-6
            self._inv = torch.where(keep, 1.0 / self.norm_weight, torch.zeros_like(self.norm_weight))
            self._kept = int(keep.sum())
        return torch.linalg.vector_norm(x.float() * self._inv, dim=-1) / self._kept ** 0.5


def load_head(model_dir: str | Path, config: Any) -> Head:
    """The final norm and LM head of a checkpoint, read alone from its safetensors files."""
    import torch
    from safetensors import safe_open

    folder = Path(model_dir)
    where = _weight_files(folder)
    names = list(where)
    norm = _pick(names, "model.norm.weight") or _pick(names, ".norm.weight")
    head = _pick(names, "lm_head.weight", exclude="\0")
    if head is None and getattr(config, "tie_word_embeddings", False):
        head = _pick(names, "embed_tokens.weight", exclude="\0")
    if norm is None or head is None:
        raise VerifyError(f"{folder}: cannot find the final norm / lm_head tensors in its safetensors files "
                          f"(found {len(names)} tensors; norm={norm}, head={head})")
    got = {}
    for name in (norm, head):
        with safe_open(str(where[name]), framework="pt") as f:
            got[name] = f.get_tensor(name).to(torch.float32)
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_epsilon", None) or 1e-6
    weight = got[norm]
    if known_norm_kind(config) == "rms_1p":  # Gemma-style: the checkpoint stores w, the model multiplies by 1 + w
        weight = 1.0 + weight
    st = where[head].stat()
    origin = f"{where[head].resolve()}|{head}|{st.st_size}|{st.st_mtime_ns}"
    return Head(weight, got[head], float(eps), (norm, head), origin)


def moments_path(origin: str) -> Path:
    """Where a head's vocabulary moments are kept: the model cache, named by the head file's digest."""
    return cache_dir() / "head_moments" / (hashlib.blake2b(origin.encode(), digest_size=12).hexdigest() + ".safetensors")


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


def stat_figures(hs: Any, names: Sequence[str]) -> dict[str, Any]:
    """`chunk_figures` of one sample."""
    return chunk_figures(hs, names, [(0, len(hs))])[0]


def chunk_figures(hs: Any, names: Sequence[str], spans: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    """The figures that need no head, for each sample `(first row, rows)` of `spans` in the states `hs` [tokens, S,
    hidden] of consecutive samples: finiteness, flat rows, duplicate layers, norm profile.

    Two reductions per row (sum and 2-norm), over all the samples at once, decide every figure; the element-wise
    tests run only on the rows (or layer pairs) those sums cannot clear, so the verdicts are exact (NaN and Inf
    count as 0 in every figure but `nonfinite`). Returns the figures per span.
    """
    import numpy as np
    import torch

    t, s, h = hs.shape
    s1, nrm = torch.empty(t, s), torch.empty(t, s)
    step = max(1, REDUCE_BYTES // (4 * s * h))  # rows per float32 block: converted and reduced while in cache
    buf = torch.empty(min(t, step), s, h)
    for a in range(0, t, step):  # converted, then reduced in float32: reducing the stored bf16 directly (sum and norm
        # with dtype=float32) took 46 ms for the embedded store's 34 MB, these three 16 ms for 64 MB (2026-12-02)
        x = buf[:min(step, t - a)]
        x.copy_(hs[a:a + step])
        torch.sum(x, -1, out=s1[a:a + step])
        torch.linalg.vector_norm(x, dim=-1, out=nrm[a:a + step])
    owner = torch.full((t,), -1, dtype=torch.long)  # the span of each row
    for i, (a, n) in enumerate(spans):
        owner[a:a + n] = i
    nonfinite, flat = [0] * len(spans), [0] * len(spans)

    def per_span(rows: Any, counts: Any, into: list[int]) -> None:  # add per-row counts to their spans'
        for i, c in zip(owner[rows].tolist(), counts.tolist()):
            if i >= 0:
                into[i] += int(c)

    odd = ~(torch.isfinite(s1) & torch.isfinite(nrm))  # a NaN/Inf element makes its row's sums non-finite
    if bool(odd.any()):
        rows = odd.any(1).nonzero()[:, 0]
        x = hs[rows].float()
        per_span(rows, (~torch.isfinite(x)).sum((1, 2)), nonfinite)
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        s1[rows], nrm[rows] = x.sum(-1), torch.linalg.vector_norm(x, dim=-1)
    ms, mu = nrm.square() / h, s1 / h
    maybe_flat = (ms - mu.square()) <= 1e-4 * ms  # a constant row has (rounding-)zero variance; others do not
    if bool(maybe_flat.any()):
        rows = maybe_flat.any(1).nonzero()[:, 0]
        cand = torch.nan_to_num(hs[rows].float(), nan=0.0, posinf=0.0, neginf=0.0)
        per_span(rows, ((cand.amax(-1) == cand.amin(-1)) & maybe_flat[rows]).sum(1), flat)
    # equal layers have equal sums and norms up to the summation order's rounding: every pair of layers of every
    # row at once [tokens, pairs], then per span whether all its rows agree (a running count of the rows that differ)
    la, lb = torch.triu_indices(s, s, 1)
    tol = 1e-4 * (nrm * h ** 0.5)
    differ = ~(((s1[:, la] - s1[:, lb]).abs() <= tol[:, la] + tol[:, lb])
               & ((nrm[:, la] - nrm[:, lb]).abs() <= 1e-4 * (nrm[:, la] + nrm[:, lb])))
    runs = torch.cat([torch.zeros(1, len(la), dtype=torch.int32), differ.to(torch.int32).cumsum(0, dtype=torch.int32)])
    first = torch.tensor([a for a, _ in spans], dtype=torch.long)
    last = torch.tensor([a + n for a, n in spans], dtype=torch.long)
    dups: list[list[list[str]]] = [[] for _ in spans]
    pairs = list(zip(la.tolist(), lb.tolist()))
    for i, j in ((runs[last] - runs[first]) == 0).nonzero().tolist():  # (span, pair) with no row that differs
        a, n = spans[i]
        if torch.equal(hs[a:a + n, pairs[j][0]], hs[a:a + n, pairs[j][1]]):
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


class HeadBatch:
    """The target's head over many samples' positions at once: at every queued position the record token's logit z
    (`Head.logit_z`, one GEMM by the covariance factor); at the positions queued as exact also the whole head (one
    GEMM per `size` of them): the record token's log-prob (log-softmax over the vocabulary) and whether it is top-1."""

    def __init__(self, head: Head, size: int = HEAD_BATCH):
        self.head, self.size = head, size
        self.pending: list[tuple[Any, Any, Any, int]] = []
        self.queued = self.queued_exact = 0
        self.got: dict[Any, dict[str, Any]] = {}
        self.positions = self.exact_positions = 0
        self.seconds = 0.0  # in the GEMMs, the log-softmax and the z's

    def add(self, tag: Any, post: Any, targets: Any, exact: int = 0) -> None:
        """Queue post-norm states `[k, hidden]` whose next tokens are `targets` `[k]`, under `tag`; the first `exact`
        of them also go through the whole head."""
        self.pending.append((tag, post, targets, min(exact, len(targets))))
        self.queued += len(targets)
        self.queued_exact += min(exact, len(targets))
        if self.queued_exact >= self.size or self.queued >= 16 * self.size:
            self.flush()

    def flush(self) -> None:
        import torch

        if not self.pending:
            return
        t0 = time.perf_counter()
        x = torch.cat([p for _, p, _, _ in self.pending])
        tgt = torch.cat([t for _, _, t, _ in self.pending]).long()
        z = self.head.logit_z(x, tgt)
        starts, at = [], 0
        for _, _, t, _ in self.pending:
            starts.append(at)
            at += len(t)
        ex = [a + j for a, (_, _, _, e) in zip(starts, self.pending) for j in range(e)]
        rank = lp = None
        if ex:
            rows = torch.tensor(ex, dtype=torch.long)
            logits = torch.nn.functional.linear(x[rows], self.head.lm_head)
            et = tgt[rows]
            best = logits.argmax(1)
            tl = logits.gather(1, et[:, None])[:, 0]
            lp = torch.log_softmax(logits, dim=-1).gather(1, et[:, None])[:, 0]  # the fused kernel; logsumexp is slower
            miss = best != et
            rank = torch.zeros_like(et)
            if bool(miss.any()):
                rank[miss] = (logits[miss] > tl[miss, None]).sum(1)  # a tie with the target's logit counts as a hit
        sizes = [len(t) for _, _, t, _ in self.pending]
        n_at = torch.tensor(sizes)
        means = torch.segment_reduce(z, "mean", lengths=n_at).tolist()  # per entry at once: few small tensor calls
        mins = torch.segment_reduce(z, "min", lengths=n_at).tolist()
        done = 0
        for (tag, _, t, e), size, mean, low in zip(self.pending, sizes, means, mins):  # one entry per (sample,
            fig = {"positions": size, "z_mean": round(mean, 3), "z_min": round(low, 3)}  # output|prompt), final
            if e:
                fig |= _position_figures(rank[done:done + e], lp[done:done + e])
                done += e
            self.got[tag] = fig
        self.positions += at
        self.exact_positions += len(ex)
        self.pending, self.queued, self.queued_exact = [], 0, 0
        self.seconds += time.perf_counter() - t0

    def figures(self, tag: Any, prefix: str) -> dict[str, Any]:
        """The head's figures of one tag (and forgets them): z positions, mean and least; at the exact positions
        their count, top-1 share and misses, log-prob median and mean, rank median; `{prefix}_positions` 0 when none."""
        got = self.got.pop(tag, None)
        if got is None:
            return {f"{prefix}_positions": 0}
        return {f"{prefix}_{k}": v for k, v in got.items()}


def _position_figures(rank: Any, lp: Any) -> dict[str, Any]:
    return {"exact_positions": len(rank), "top1": round(float((rank == 0).float().mean()), 4),
            "misses": int((rank > 0).sum()), "logprob_median": round(float(lp.median()), 4),
            "logprob_mean": round(float(lp.mean()), 4), "rank_median": int(rank.median())}


def head_figures(hs: Any, ids: Any, mask: Any, names: Sequence[str], head: Head, samples: Sequence[dict[str, Any]],
                 batch: HeadBatch | None = None) -> list[dict[str, Any]]:
    """The head's figures of consecutive stored samples: the final state's kind and the head at sampled positions.

    `hs` [tokens, S, H], `ids`, `mask`: the stored states (the store's order `names`: aux low, mid, high, then the
    final state(s)), ids and loss mask of the samples; per sample of `samples`: `at` (its first row), `length`,
    `key`, `k` ((exact, output z, prompt z) head positions from `exact_plan` and `head_counts`, 0 exact = none; or one
    count for all three, 0 = all), `prompt_from` (`unique_starts`) and `tag`. The exact output positions are a subset
    of the output z ones; the prompt ones start at `prompt_from`. With `batch`, the head's positions are queued under
    (tag, "out"|"prompt") and their figures come from `batch.figures` once it is flushed; without, they are computed
    here. The final states at every chosen row are gathered, normed and judged for their kind at once.
    """
    import numpy as np
    import torch

    finals = {nm: i for i, nm in enumerate(names) if nm in ("pre_norm", "post_norm")}
    m_all = np.asarray(mask)
    plans, rows = [], []
    for smp in samples:
        a, n, key, k = smp["at"], smp["length"], smp["key"], smp["k"]
        k_exact, k_out, k_prompt = (k, k, k) if isinstance(k, int) else k
        nxt = m_all[a + 1:a + n]  # at position t the head predicts token t + 1
        out_at = positions(key, np.flatnonzero(nxt).tolist(), k_out, first=True)
        exact_at = positions(key + "#exact", out_at, k_exact, first=True) if k_exact or isinstance(k, int) else []
        chosen = set(exact_at)
        out_at = exact_at + [t for t in out_at if t not in chosen]  # the exact ones first: HeadBatch takes a prefix
        prompt = np.flatnonzero(nxt == 0)
        prompt_at = positions(key + "#prompt", prompt[prompt >= smp.get("prompt_from", 0)].tolist(), k_prompt)
        at_all = out_at + prompt_at or list(range(n))
        plans.append((out_at, len(exact_at), prompt_at, len(at_all)))
        rows.append(torch.tensor(at_all, dtype=torch.long) + a)
    rows_all = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    cols = torch.tensor(list(finals.values()), dtype=torch.long)
    t, s, h = hs.shape
    flat = hs.reshape(t * s, h).index_select(0, (rows_all[:, None] * s + cols[None]).reshape(-1))  # one gather
    fin = torch.nan_to_num(flat.view(-1, len(cols), h).float(), nan=0.0, posinf=0.0, neginf=0.0)
    # the final state's kind, at the head's rows (a clean store gives a share of exactly 1 or 0 at any rows)
    counts = torch.tensor([p[3] for p in plans], dtype=torch.long)
    unit = ((head.unit_rms(fin) - 1).abs() < UNIT_RMS_TOL).float()
    shares = torch.segment_reduce(unit, "mean", lengths=counts, axis=0).tolist() if len(plans) else []
    post = fin[:, list(finals).index("post_norm")] if "post_norm" in finals else head.norm(fin[:, 0])
    targets = ids[(rows_all + 1).clamp(max=max(len(ids) - 1, 0))]  # the next token (used at out/prompt rows only)
    own = batch is None
    batch = HeadBatch(head) if own else batch
    out, lo = [], 0
    for smp, (out_at, n_exact, prompt_at, count), share in zip(samples, plans, shares):
        for first, at, prefix, exact in ((lo, out_at, "out", n_exact), (lo + len(out_at), prompt_at, "prompt", 0)):
            if at:
                batch.add((smp["tag"], prefix), post[first:first + len(at)], targets[first:first + len(at)], exact)
        out.append({"unit_rms_share": {nm: round(share[j], 4) for j, nm in enumerate(finals)}})
        lo += count
    if own:
        batch.flush()
        for smp, fig in zip(samples, out):
            fig.update(batch.figures((smp["tag"], "out"), "out") | batch.figures((smp["tag"], "prompt"), "prompt"))
    return out


# ---------------------------------------------------------------------------- verdicts


def binom_tail(k: int, q: float, m: int) -> float:
    """P(X >= m) for X ~ Binomial(k, q)."""
    return sum(math.comb(k, j) * q ** j * (1 - q) ** (k - j) for j in range(max(m, 0), k + 1))


@functools.lru_cache(maxsize=None)
def top1_limit(k: int) -> int:
    """The fewest top-1 misses of `k` output positions that fail a greedy sample: a clean sample (miss rate
    TOP1_CLEAN_MISS) reaches it with probability <= TOP1_ALPHA (k + 1, never, when k is too small for that)."""
    return next((m for m in range(k + 1) if binom_tail(k, TOP1_CLEAN_MISS, m) <= TOP1_ALPHA), k + 1)


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


def judge(fig: dict[str, Any], stats: dict[str, Any], *, greedy: bool, judge_profile: bool) -> tuple[list[str], dict[str, Any]]:
    """The checks one sample fails (names of `CHECKS`) and the z-scores behind the run-relative ones."""
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
                                                ("out_z_mean", "head_logit_z", MIN_OUT_Z if greedy else
                                                 MIN_SAMPLED_OUT_Z, Z_SPREAD_FLOOR),
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


def compare_states(stored: Any, ref: Any, names: Sequence[str], dtype: str) -> dict[str, Any]:
    """Per stored layer: the share of elements beyond the dtype's tolerance of a fresh forward, and the worst."""
    s, r = stored.float(), ref.float()
    rtol, atol = RECOMPUTE_RTOL.get(dtype, 1e-2), RECOMPUTE_ATOL_SHARE.get(dtype, 1e-2)
    out: dict[str, Any] = {}
    for i, nm in enumerate(names):
        a, b = s[:, i], r[:, i]
        row = b.pow(2).mean(-1, keepdim=True).sqrt()
        err = (a - b).abs()
        tol = rtol * b.abs() + atol * row
        off = ~(err <= tol)  # NaN counts as off
        out[nm] = {"off_share": round(float(off.float().mean()), 6), "gross": int((~(err <= GROSS * tol)).sum()),
                   "max_rel": round(float((err / (row + 1e-30)).nan_to_num(float("inf")).max()), 6)}
    return out


def recompute_failed(cmp: dict[str, Any]) -> bool:
    """A layer has more than MAX_OFF_SHARE of its elements off, or one grossly off."""
    return any(v["off_share"] > MAX_OFF_SHARE or v["gross"] for v in cmp.values())
