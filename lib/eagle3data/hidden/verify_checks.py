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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import orjson

from eagle3data.core.errors import UserInputError
from eagle3data.hidden.norms import known_norm_kind

# Limits measured on clean stores (docs/04 "Verify" gives the figures they come from).
# head_top1 (greedy records): a sample fails when its top-1 misses at K output positions are more than a clean
# sample gives with probability TOP1_ALPHA, for a clean miss rate of TOP1_CLEAN_MISS (above the worst measured).
TOP1_CLEAN_MISS = 0.03
TOP1_ALPHA = 1e-6
# Head positions per sample (docs/04 "Head positions"): at least OUT_FLOOR output and PROMPT_FLOOR prompt positions
# (the power the mutation tests need, from the measured clean and broken rates), more when the sample is long
# enough that HEAD_FLOPS_PER_BYTE x its stored bytes buys more, at most the `positions` cap.
OUT_FLOOR = 16
PROMPT_FLOOR = 64
HEAD_FLOPS_PER_BYTE = 20.0
HEAD_BATCH = 512  # positions per head GEMM, across samples
MIN_OUT_LOGPROB = -4.0  # median log-prob of the record's next output token
MIN_PROMPT_LOGPROB = -7.0  # mean log-prob of the record's next prompt token
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
    "head_top1": "greedy records: the head's top-1 is the record's next token at the sampled output positions",
    "head_logprob": "the record's next output token is likely under the head (median log-prob; vs the run)",
    "prompt_logprob": "the record's next prompt token is likely under the head (mean log-prob; vs the run)",
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

    def norm(self, x: Any) -> Any:
        """The final RMSNorm of pre-norm states `[..., hidden]` (float32)."""
        import torch

        x = x.float()
        return self.norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def log_probs(self, post: Any) -> Any:
        """Log-softmax of the head over the vocabulary for post-norm states `[k, hidden]`."""
        import torch

        return torch.log_softmax(post.float() @ self.lm_head.T, dim=-1)

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
    return Head(weight, got[head], float(eps), (norm, head))


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


def head_counts(n_bytes: int, flops_per_position: float, cap: int) -> tuple[int, int]:
    """(output, prompt) head positions for a sample of `n_bytes` stored: the floors, raised by the budget
    (HEAD_FLOPS_PER_BYTE x the bytes read) up to `cap`; `cap` 0 = every position (returned as 0)."""
    if cap <= 0:
        return 0, 0
    budget = int(HEAD_FLOPS_PER_BYTE * n_bytes // max(flops_per_position, 1.0))
    return (min(cap, max(OUT_FLOOR, budget)), min(cap, max(PROMPT_FLOOR, budget)))


def stat_figures(hs: Any, names: Sequence[str]) -> tuple[dict[str, Any], Any]:
    """The figures of one sample's states that need no head: finiteness, flat rows, duplicate layers, norm profile.

    Two reductions per row (sum and 2-norm) decide every figure; the element-wise tests run only on the
    rows (or layer pairs) those sums cannot clear, so the verdicts are exact. Returns the figures and the
    states as float32 (NaN/Inf zeroed) for the head.
    """
    import torch

    x = hs.float()
    n, s, h = x.shape
    s1 = x.sum(-1)  # [n, S]
    nrm = torch.linalg.vector_norm(x, dim=-1)
    out: dict[str, Any] = {"nonfinite": 0}
    odd = ~(torch.isfinite(s1) & torch.isfinite(nrm))  # a NaN/Inf element makes its row's sums non-finite
    if bool(odd.any()):
        out["nonfinite"] = int((~torch.isfinite(x[odd])).sum())
        if out["nonfinite"]:
            x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
            s1, nrm = x.sum(-1), torch.linalg.vector_norm(x, dim=-1)
    ms, mu = nrm.square() / h, s1 / h
    maybe_flat = (ms - mu.square()) <= 1e-4 * ms  # a constant row has (rounding-)zero variance; others do not
    flat = x[maybe_flat]
    out["flat_rows"] = int((flat.amax(-1) == flat.amin(-1)).sum()) if len(flat) else 0
    tol = 1e-4 * (nrm * h ** 0.5)  # equal layers have equal sums up to the summation order's rounding
    out["duplicate_layers"] = [[names[a], names[b]] for a in range(s) for b in range(a + 1, s)
                               if bool(((s1[:, a] - s1[:, b]).abs() <= tol[:, a] + tol[:, b]).all())
                               and bool(((nrm[:, a] - nrm[:, b]).abs() <= 1e-4 * (nrm[:, a] + nrm[:, b])).all())
                               and torch.equal(hs[:, a], hs[:, b])]
    rms = nrm / h ** 0.5
    rest = rms[1:] if n > 1 else rms
    med = rest.median(0).values.clamp_min(1e-30)
    out["log_rms"] = {names[i]: round(math.log(float(med[i])), 4) for i in range(s)}
    out["row0"] = {names[i]: round(math.log(max(float(rms[0, i]), 1e-30) / float(med[i])), 4) for i in range(s)}
    return out, x


class HeadBatch:
    """The target's head over many samples' positions at once: one GEMM per `size` positions, then per position
    the record token's log-prob (log-softmax over the whole vocabulary) and whether it is the top-1."""

    def __init__(self, head: Head, size: int = HEAD_BATCH):
        self.head, self.size = head, size
        self.pending: list[tuple[Any, Any, Any]] = []
        self.queued = 0
        self.got: dict[Any, dict[str, Any]] = {}
        self.positions = 0
        self.seconds = 0.0  # in the GEMMs and the log-softmax

    def add(self, tag: Any, post: Any, targets: Any) -> None:
        """Queue post-norm states `[k, hidden]` whose next tokens are `targets` `[k]`, under `tag`."""
        self.pending.append((tag, post, targets))
        self.queued += len(targets)
        if self.queued >= self.size:
            self.flush()

    def flush(self) -> None:
        import torch

        if not self.pending:
            return
        t0 = time.perf_counter()
        x = torch.cat([p for _, p, _ in self.pending])
        tgt = torch.cat([t for _, _, t in self.pending]).long()
        logits = torch.nn.functional.linear(x, self.head.lm_head)
        best = logits.argmax(1)
        tl = logits.gather(1, tgt[:, None])[:, 0]
        lp = torch.log_softmax(logits, dim=-1).gather(1, tgt[:, None])[:, 0]  # the fused kernel; logsumexp is slower
        miss = best != tgt
        rank = torch.zeros_like(tgt)
        if bool(miss.any()):
            rank[miss] = (logits[miss] > tl[miss, None]).sum(1)  # a tie with the target's logit counts as a hit
        at = 0
        for tag, _, t in self.pending:  # one entry per (sample, output|prompt): its figures, final once flushed
            k = len(t)
            self.got[tag] = _position_figures(rank[at:at + k], lp[at:at + k])
            at += k
        self.positions += at
        self.pending, self.queued = [], 0
        self.seconds += time.perf_counter() - t0

    def figures(self, tag: Any, prefix: str) -> dict[str, Any]:
        """The head's figures of one tag (and forgets them): positions, top-1 share and misses, log-prob median
        and mean, rank median; `{prefix}_positions` 0 when it had none."""
        got = self.got.pop(tag, None)
        if got is None:
            return {f"{prefix}_positions": 0}
        return {f"{prefix}_{k}": v for k, v in got.items()}


def _position_figures(rank: Any, lp: Any) -> dict[str, Any]:
    return {"positions": len(rank), "top1": round(float((rank == 0).float().mean()), 4),
            "misses": int((rank > 0).sum()), "logprob_median": round(float(lp.median()), 4),
            "logprob_mean": round(float(lp.mean()), 4), "rank_median": int(rank.median())}


def sample_figures(key: str, hs: Any, ids: Any, mask: Any, names: Sequence[str], head: Head | None,
                   k: int | tuple[int, int], batch: HeadBatch | None = None, tag: Any = None) -> dict[str, Any]:
    """Every figure of one stored sample: finiteness, flat rows, layer duplicates, final kind, head, norm profile.

    `hs` [n, S, H] in the store's order `names` (aux low, mid, high, then the final state(s)); `k`: output
    and prompt head positions (one count for both; 0 = all). With `batch`, the head's positions are queued
    under `tag` and their figures come from `batch.figures` once it is flushed; without, they are computed here.
    """
    import torch

    out, x = stat_figures(hs, names)
    if head is None:
        return out
    finals = {nm: i for i, nm in enumerate(names) if nm in ("pre_norm", "post_norm")}
    out["unit_rms_share"] = {nm: round(float(((head.unit_rms(x[:, i]) - 1).abs() < UNIT_RMS_TOL).float().mean()), 4)
                             for nm, i in finals.items()}
    k_out, k_prompt = (k, k) if isinstance(k, int) else k
    m = mask.tolist()
    n = len(m)
    out_at = positions(key, [t for t in range(n - 1) if m[t + 1]], k_out, first=True)
    prompt_at = positions(key + "#prompt", [t for t in range(n - 1) if not m[t + 1]], k_prompt)
    own = batch is None
    batch = HeadBatch(head) if own else batch
    for at, prefix in ((out_at, "out"), (prompt_at, "prompt")):
        if not at:
            continue
        rows = torch.tensor(at, dtype=torch.long)
        post = x[rows, finals["post_norm"]] if "post_norm" in finals else head.norm(x[rows, finals["pre_norm"]])
        batch.add((tag, prefix), post, ids[rows + 1])
    if own:
        batch.flush()
        out.update(batch.figures((tag, "out"), "out") | batch.figures((tag, "prompt"), "prompt"))
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
    for fig in ("out_logprob_median", "prompt_logprob_mean"):
        vals = [r[fig] for r in rows if r.get(fig) is not None]
        if vals:
            out[fig] = {"": robust_centre(vals)}
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
    if greedy and fig.get("out_positions") and fig["out_misses"] >= top1_limit(fig["out_positions"]):
        failed.append("head_top1")
    for figname, check, floor in (("out_logprob_median", "head_logprob", MIN_OUT_LOGPROB),
                                  ("prompt_logprob_mean", "prompt_logprob", MIN_PROMPT_LOGPROB)):
        v = fig.get(figname)
        if v is None:
            continue
        low = v < floor
        if judge_profile and figname in stats:
            med, spread = stats[figname][""]
            z[figname] = round((v - med) / max(spread, 0.5), 2)
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
