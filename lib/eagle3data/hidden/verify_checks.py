"""The per-sample figures and verdicts of `verify-hidden` (`verify.py` streams the store through them).

Every figure is computed from one stored sample alone (read once); the verdicts compare it
with fixed limits measured on clean stores (docs/04 "Verify") and with the run's own samples
(median and MAD across samples), so a sample that differs from its run stands out.

The target's head is read from the checkpoint alone: the final norm's weight and `lm_head`
(or the tied input embedding), a few tensors of the safetensors files, never the model.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import orjson

from eagle3data.core.errors import UserInputError

# Limits measured on clean stores (docs/04 "Verify" gives the figures they come from).
MIN_TOP1_GREEDY = 0.85  # share of output positions whose top-1 is the record's next token (greedy records)
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
        """rms(state / norm weight) per row: 1 for a post-norm state (up to eps and rounding)."""
        w = self.norm_weight
        keep = w.abs() > 1e-6
        return (x.float()[..., keep] / w[keep]).pow(2).mean(-1).sqrt()


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
    return Head(got[norm], got[head], float(eps), (norm, head))


# ---------------------------------------------------------------------------- per-sample figures


def positions(key: str, candidates: list[int], k: int) -> list[int]:
    """Up to `k` of `candidates` (all when k <= 0 or fewer), the same for the same key on every run."""
    if k <= 0 or len(candidates) <= k:
        return candidates
    import random

    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return sorted(random.Random(seed).sample(candidates, k))


def _head_figures(head: Head, post: Any, ids: Any, at: list[int], prefix: str) -> dict[str, Any]:
    import torch

    if not at:
        return {f"{prefix}_positions": 0}
    lp = head.log_probs(post[at])
    tgt = ids[torch.tensor(at) + 1].long()
    tlp = lp.gather(1, tgt[:, None])[:, 0]
    rank = (lp > tlp[:, None]).sum(1)
    return {f"{prefix}_positions": len(at), f"{prefix}_top1": round(float((rank == 0).float().mean()), 4),
            f"{prefix}_logprob_median": round(float(tlp.median()), 4),
            f"{prefix}_logprob_mean": round(float(tlp.mean()), 4),
            f"{prefix}_rank_median": int(rank.median())}


def sample_figures(key: str, hs: Any, ids: Any, mask: Any, names: Sequence[str], head: Head | None,
                   k: int) -> dict[str, Any]:
    """Every figure of one stored sample: finiteness, flat rows, layer duplicates, final kind, head, norm profile.

    `hs` [n, S, H] in the store's order `names` (aux low, mid, high, then the final state(s)).
    """
    import torch

    x = hs.float()
    bad = ~torch.isfinite(x)
    out: dict[str, Any] = {"nonfinite": int(bad.sum())}
    if out["nonfinite"]:
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    n, s = x.shape[0], x.shape[1]
    rms = x.pow(2).mean(-1).sqrt()  # [n, S]
    out["flat_rows"] = int(((x.amax(-1) - x.amin(-1)) == 0).sum())
    out["duplicate_layers"] = [[names[a], names[b]] for a in range(s) for b in range(a + 1, s)
                               if torch.equal(hs[:, a], hs[:, b])]
    rest = rms[1:] if n > 1 else rms
    med = rest.median(0).values.clamp_min(1e-30)
    out["log_rms"] = {names[i]: round(math.log(float(med[i])), 4) for i in range(s)}
    out["row0"] = {names[i]: round(math.log(max(float(rms[0, i]), 1e-30) / float(med[i])), 4) for i in range(s)}
    if head is None:
        return out
    finals = {nm: x[:, i] for i, nm in enumerate(names) if nm in ("pre_norm", "post_norm")}
    out["unit_rms_share"] = {nm: round(float(((head.unit_rms(t) - 1).abs() < UNIT_RMS_TOL).float().mean()), 4)
                             for nm, t in finals.items()}
    post = finals["post_norm"] if "post_norm" in finals else head.norm(finals["pre_norm"])
    m = mask.tolist()
    out_at = positions(key, [t for t in range(n - 1) if m[t + 1]], k)
    prompt_at = positions(key + "#prompt", [t for t in range(n - 1) if not m[t + 1]], k)
    out.update(_head_figures(head, post, ids, out_at, "out"))
    out.update(_head_figures(head, post, ids, prompt_at, "prompt"))
    return out


# ---------------------------------------------------------------------------- verdicts


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
    if greedy and fig.get("out_top1") is not None and fig["out_top1"] < MIN_TOP1_GREEDY:
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
