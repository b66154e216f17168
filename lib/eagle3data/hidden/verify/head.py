"""The target's head for `verify-hidden`: read alone from the checkpoint, its vocabulary moments (the logit z), and
the head over many samples' positions at once (`HeadBatch`, `head_figures`).

The final norm's weight and `lm_head` (or the tied input embedding) are a few tensors of the safetensors files,
never the model.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from eagle3data.core.atomic import atomic_path, follow_umask
from eagle3data.core.models import cache_dir, text_config
from eagle3data.hidden.norms import read_final_norm, rms_norm, weight_files
from eagle3data.hidden.verify.checks import UNIT_RMS_TOL, VerifyError, positions

HEAD_BATCH = 512  # positions per head GEMM, across samples
UNIT_ROWS = 32  # rows per sample at which the final state's kind is judged (`head_figures`)
LSE_ROWS = 16  # logit rows reduced at once by `_argmax_logsumexp` (16 x 49,152 float32 = 3 MiB)


def _shortest(names: Sequence[str], suffix: str) -> str | None:
    got = sorted((n for n in names if n.endswith(suffix)), key=len)
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
        return rms_norm(x, self.norm_weight, self.eps)

    def moments(self) -> tuple[Any, Any]:
        """(mean row `[hidden]`, a factor F `[hidden, hidden]` of the rows' covariance, F F^T = cov): for any state x
        the vocabulary's mean logit is x . mean and the variance of its logits is |x F|^2, exactly. Computed once per
        checkpoint (float64 sums of a hidden^2 x vocab GEMM, then eigh) and kept in the model cache (`moments_path`)."""
        if self._moments is None:
            from safetensors.torch import load_file, save_file

            path = moments_path(self.origin) if self.origin else None
            if path is not None and path.exists():
                follow_umask(path.parent)  # moments written 0600 before the rule: readable as the umask allows
                got = load_file(str(path))
                self._moments = (got["mean"], got["factor"])
            else:
                self._moments = self._compute_moments()
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with atomic_path(path, tmp_suffix=f".{os.getpid()}.tmp") as tmp:  # the umask's mode, not 0600
                        save_file({"mean": self._moments[0], "factor": self._moments[1]}, str(tmp))
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
    """The final norm and LM head of a checkpoint, read alone from its safetensors files (`norms.read_final_norm`:
    the norm's weight, its kind and eps from the text config, as the vLLM backend's post-norm state reads them)."""
    import torch
    from safetensors import safe_open

    folder = Path(model_dir)
    where = weight_files(folder)
    names = list(where)
    text = text_config(config)  # a multimodal target (Kimi-K2.5, Llava-style) keeps eps and tying in text_config
    norm = read_final_norm(folder, config, where)
    head = _shortest(names, "lm_head.weight")
    if head is None and (getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)):
        head = _shortest(names, "embed_tokens.weight")
    if norm is None or head is None:
        raise VerifyError(f"{folder}: cannot find the final norm / lm_head tensors in its safetensors files "
                          f"(found {len(names)} tensors; norm={norm and norm.name}, head={head})")
    if norm.eps is None:
        raise VerifyError(f"{folder}: its config has no rms_norm_eps (nor layer_norm_epsilon): cannot apply the final "
                          "norm")
    with safe_open(str(where[head]), framework="pt") as f:
        weight = f.get_tensor(head).to(torch.float32)
    st = where[head].stat()
    origin = f"{where[head].resolve()}|{head}|{st.st_size}|{st.st_mtime_ns}"
    return Head(norm.multiplier, weight, norm.eps, (norm.name, head), origin)


def moments_path(origin: str) -> Path:
    """Where a head's vocabulary moments are kept: the model cache, named by the head file's digest."""
    return cache_dir() / "head_moments" / (hashlib.blake2b(origin.encode(), digest_size=12).hexdigest() + ".safetensors")


# ---------------------------------------------------------------------------- the head over many samples


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
            best, lse = _argmax_logsumexp(logits)
            tl = logits.gather(1, et[:, None])[:, 0]
            lp = tl - lse
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


def _argmax_logsumexp(logits: Any, rows: int = LSE_ROWS) -> tuple[Any, Any]:
    """Per row of `logits` [k, vocab]: (the index of its largest value, log-sum-exp), `rows` rows at a time while they
    are in cache: one `torch.max` gives the largest value and its index, then exp(logits - max) is summed. On 308 x
    49,152 float32 logits 10.7 ms, against 37.7 ms for argmax and log_softmax (2026-12-04, docs/04 "Cost")."""
    import torch

    best, lse = torch.empty(len(logits), dtype=torch.long), torch.empty(len(logits))
    for a in range(0, len(logits), rows):
        m, best[a:a + rows] = torch.max(logits[a:a + rows], 1)
        lse[a:a + rows] = m + torch.sub(logits[a:a + rows], m[:, None]).exp_().sum(1).log_()
    return best, lse


def _position_figures(rank: Any, lp: Any) -> dict[str, Any]:
    return {"exact_positions": len(rank), "top1": round(float((rank == 0).float().mean()), 4),
            "misses": int((rank > 0).sum()), "logprob_median": round(float(lp.median()), 4),
            "logprob_mean": round(float(lp.mean()), 4), "rank_median": int(rank.median())}


def head_figures(hs: Any, ids: Any, mask: Any, names: Sequence[str], head: Head, samples: Sequence[dict[str, Any]],
                 batch: HeadBatch | None = None, finite: bool = False) -> list[dict[str, Any]]:
    """The head's figures of consecutive stored samples: the final state's kind and the head at sampled positions.

    `hs` [tokens, S, H], `ids`, `mask`: the stored states (the store's order `names`: aux low, mid, high, then the
    final state(s)), ids and loss mask of the samples; per sample of `samples`: `at` (its first row), `length`,
    `key`, `k` ((exact, output z, prompt z) head positions from `exact_plan` and `head_counts`, 0 exact = none; or one
    count for all three, 0 = all), `prompt_from` (`unique_starts`) and `tag`. The exact output positions are a subset
    of the output z ones; the prompt ones start at `prompt_from`. With `batch`, the head's positions are queued under
    (tag, "out"|"prompt") and their figures come from `batch.figures` once it is flushed; without, they are computed
    here. The final states at every chosen row are gathered and normed at once; their kind is judged at the first
    UNIT_ROWS of each sample's rows. `finite`: the caller knows these states hold no NaN or Inf (`chunk_figures` found
    none), so they are not cleaned (NaN and Inf count as 0 otherwise).
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
    fin = flat.view(-1, len(cols), h).float()
    if not finite:
        torch.nan_to_num_(fin, nan=0.0, posinf=0.0, neginf=0.0)
    # the final state's kind at the first UNIT_ROWS head rows of each sample (a clean store gives a share of exactly 1
    # or 0 at any rows; every row of the state changes kind when a whole state is stored as the other kind)
    shares = []
    if plans:
        starts = np.cumsum([0] + [p[3] for p in plans[:-1]]).tolist()  # each sample's first row in rows_all
        counts = [min(p[3], UNIT_ROWS) for p in plans]
        pick = torch.cat([torch.arange(c) + a for c, a in zip(counts, starts)])
        unit = ((head.unit_rms(fin[pick]) - 1).abs() < UNIT_RMS_TOL).float()
        shares = torch.segment_reduce(unit, "mean", lengths=torch.tensor(counts), axis=0).tolist()
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
