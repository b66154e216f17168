"""How sure a τ figure is: its spread over training seeds, a Δτ judged against evaluation *and* training noise,
and τ's slope per doubling of training tokens.

**Seed spread**: one evaluation set's τ from drafts trained with different seeds and nothing
else different: n, mean, sample sd (n − 1), min, max.

**A Δτ**: two variants A and B (B − A), each τ the pooled ratio over the same evaluation prompts;
with several seeds per variant, each prompt's counts summed over its seeds (the seed-pooled ratio). Two noises:
- evaluation: the paired bootstrap interval [lo, hi] over prompts (`run.paired_diff`; reported as a standard
  error se_eval = (hi − lo) / (2 · 1.96));
- training: a draft's τ moves by σ (the seed sd, measured on one variant with df = seeds − 1, and taken to hold
  for the other: the same recipe and budget); the difference of an mA-seed and an mB-seed mean has
  se_seed = σ · √(1/mA + 1/mB).
They are independent (the bootstrap holds the drafts fixed, the seed spread the prompts), so each end of the
evaluation interval is widened by the seed term's own 95% half-width h_seed = t(0.975, df_σ) · se_seed, in
quadrature: [Δ − √((Δ − lo)² + h_seed²), Δ + √((hi − Δ)² + h_seed²)] (the bootstrap's asymmetry kept). Each noise
alone gives its exact interval (the bootstrap's; Student's t on σ's few degrees of freedom); together, the
quadrature of half-widths is at least the interval of the summed variance, so it errs wide (measured on
synthetic draws, `tests/test_value_spread.py`: 95–98% coverage; a Welch–Satterthwaite df instead covered
93% with σ from 3 seeds, its df jumping up whenever σ's estimate came out small).
**Significant** when that interval excludes 0. With no seed spread measured, the interval is the evaluation
interval alone and the verdict says so (`judged_against: ["evaluation"]`): row order alone moved τ by 1%.

**The data-size slope**: τ = a + b · log2(training tokens), least squares over the points;
b is τ's gain per doubling. Its interval:
- evaluation noise by a **paired bootstrap over prompts**: every resample draws one set of prompt indices and
  recomputes every point's pooled τ on it (the points share their prompts, so a hard prompt moves them
  together and most of that leaves the slope), then refits;
- training noise as for a Δτ: independent σ² / m_i on point i (m_i seeds) gives the slope a variance
  σ² · Σ (x_i − x̄)² / m_i / Sxx²;
- combined as above: the bootstrap's percentile interval, each end widened in quadrature by
  t(0.975, df_σ) · se_seed (without σ: the percentile interval alone).
`ci95_fit` is the regression's own t-interval (residual scatter, df = points − 2): it also sees
  curvature and any noise not measured, on few degrees of freedom; where it is the wider, the points scatter
  more than the measured noise explains (the law is not log-linear over the range, or a noise is unmeasured),
  and it is the one to quote.
"""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

import numpy as np

BOOTSTRAP = 2000
Z975 = 1.959963984540054


def ratio_ci(num: Sequence[float], den: Sequence[float], seed: int = 0) -> tuple[float | None, list[float] | None]:
    """1 + Σnum/Σden over prompts, with a 95% percentile bootstrap interval over prompts (seeded)."""
    pairs = [(a, b) for a, b in zip(num, den) if b]
    if not pairs:
        return None, None
    est = 1 + sum(a for a, _ in pairs) / sum(b for _, b in pairs)
    rng = random.Random(seed)
    boots = []
    for _ in range(BOOTSTRAP):
        s = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        boots.append(1 + sum(a for a, _ in s) / sum(b for _, b in s))
    boots.sort()
    return round(est, 4), [round(boots[int(0.025 * BOOTSTRAP)], 4), round(boots[int(0.975 * BOOTSTRAP) - 1], 4)]


def paired_diff(base: Sequence[tuple[float, float]], other: Sequence[tuple[float, float]],
                seed: int = 0) -> tuple[float | None, list[float] | None]:
    """τ(other) − τ(base), each 1 + Σaccepted/Σsteps over the same prompts, with a 95% bootstrap interval that
    resamples prompts jointly (paired: a prompt easy for one draft is easy for the other)."""
    pairs = [(a, b) for a, b in zip(base, other) if a[1] and b[1]]
    if not pairs:
        return None, None

    def d(ps: Sequence[tuple[tuple[float, float], tuple[float, float]]]) -> float:
        return sum(b[0] for _, b in ps) / sum(b[1] for _, b in ps) - sum(a[0] for a, _ in ps) / sum(a[1] for a, _ in ps)

    rng = random.Random(seed)
    boots = sorted(d([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(BOOTSTRAP))
    return round(d(pairs), 4), [round(boots[int(0.025 * BOOTSTRAP)], 4), round(boots[int(0.975 * BOOTSTRAP) - 1], 4)]


def t975(df: float) -> float:
    """Student's t 0.975 quantile for df > 0 (df = inf: the normal's 1.95996); the density integrated by Simpson's
    rule and the quantile found by bisection (no scipy in the project)."""
    if df <= 0:
        raise ValueError(f"df {df} ≤ 0")
    if math.isinf(df) or df > 1e7:
        return Z975
    logc = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf_minus_half(x: float, n: int = 800) -> float:
        xs = np.linspace(0.0, x, n + 1)
        f = np.exp(logc - (df + 1) / 2 * np.log1p(xs * xs / df))
        return float((x / n / 3) * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()))

    lo, hi = 0.0, 1.0
    while cdf_minus_half(hi) < 0.475:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf_minus_half(mid) < 0.475 else (lo, mid)
    return (lo + hi) / 2


def seed_spread(taus: Sequence[float]) -> dict[str, Any]:
    """One evaluation set's τ over training seeds: `seeds`, `mean`, `sd` (n − 1; None for one seed), `min`, `max`."""
    v = np.asarray([t for t in taus if t is not None], dtype=float)
    if not len(v):
        return {"seeds": 0, "mean": None, "sd": None, "min": None, "max": None}
    return {"seeds": len(v), "mean": round(float(v.mean()), 4),
            "sd": round(float(v.std(ddof=1)), 4) if len(v) > 1 else None,
            "min": round(float(v.min()), 4), "max": round(float(v.max()), 4)}


def _widened(est: float, lo: float, hi: float, seed_sd: float, seed_df: int, weight: float) -> list[float]:
    """The evaluation interval [lo, hi] around est, each end widened in quadrature by t(0.975, df_σ) · σ · √weight."""
    h = t975(seed_df) * seed_sd * math.sqrt(weight)
    return [est - math.hypot(est - lo, h), est + math.hypot(hi - est, h)]


def judge_diff(diff: float, eval_ci95: Sequence[float], seed_sd: float | None = None, seed_df: int | None = None,
               seeds_a: int = 1, seeds_b: int = 1) -> dict[str, Any]:
    """A Δτ (B − A) judged against evaluation noise (its paired bootstrap interval) and training-seed noise (σ with
    df_σ, the variants' seed counts): the module's rule. Returns `diff`, `ci95`, `se_eval`, `se_seed`, `seed_df`,
    `significant`, `judged_against`."""
    lo, hi = float(eval_ci95[0]), float(eval_ci95[1])
    se_eval = (hi - lo) / (2 * Z975)
    out: dict[str, Any] = {"diff": round(diff, 4), "se_eval": round(se_eval, 5)}
    if seed_sd is None or not seed_df:
        ci, out["se_seed"], out["seed_df"], out["judged_against"] = [lo, hi], None, None, ["evaluation"]
    else:
        w = 1 / seeds_a + 1 / seeds_b
        ci = _widened(diff, lo, hi, seed_sd, seed_df, w)
        out["se_seed"], out["seed_df"] = round(seed_sd * math.sqrt(w), 5), seed_df
        out["judged_against"] = ["evaluation", "training seeds"]
    out["ci95"] = [round(ci[0], 4), round(ci[1], 4)]
    out["significant"] = ci[0] > 0 or ci[1] < 0
    return out


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
    """Least squares y = a + b·x along the last axis of y: (b, a)."""
    xc = x - x.mean()
    b = (y - y.mean(-1, keepdims=True)) @ xc / (xc @ xc)
    return b, y.mean(-1) - b * x.mean()


def size_slope(tokens: Sequence[float], per_prompt: Sequence[Sequence[tuple[float, float]]], seed: int = 0,
               seed_sd: float | None = None, seed_df: int | None = None, seeds: Sequence[int] | None = None,
               resamples: int = BOOTSTRAP) -> dict[str, Any]:
    """τ's gain per doubling of training tokens, with its intervals (the module's rule).

    `tokens[i]`: point i's training tokens; `per_prompt[i]`: its (accepted, steps) per evaluation prompt, the same
    prompts in the same order at every point (offline: accepted and anchors); `seeds[i]`: how many seeds point i
    pools (default 1); σ, df_σ: the seed sd as for a Δτ."""
    x = np.log2(np.asarray(tokens, dtype=float))
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError("a slope needs at least two different training sizes")
    counts = np.asarray(per_prompt, dtype=float)  # [points, prompts, 2]
    if counts.ndim != 3 or counts.shape[0] != len(x) or counts.shape[2] != 2:
        raise ValueError("per_prompt: one list of (accepted, steps) per point, over the same prompts")
    acc, steps = counts[..., 0], counts[..., 1]
    tau = 1 + acc.sum(1) / steps.sum(1)
    b, a = _fit(x, tau)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, acc.shape[1], size=(resamples, acc.shape[1]))
    tau_b = 1 + acc[:, idx].sum(-1) / steps[:, idx].sum(-1)       # [points, resamples]
    slopes, _ = _fit(x, tau_b.T)
    se_boot = float(slopes.std(ddof=1))
    out: dict[str, Any] = {"slope_per_doubling": round(float(b), 4), "intercept": round(float(a), 4),
                           "points": [{"tokens": int(t), "tau": round(float(v), 4)} for t, v in zip(tokens, tau)],
                           "se_eval": round(se_boot, 5)}
    ci = [float(np.quantile(slopes, 0.025)), float(np.quantile(slopes, 0.975))]
    if seed_sd is None or not seed_df:
        out["se_seed"], out["seed_df"], out["judged_against"] = None, None, ["evaluation"]
    else:
        m = np.ones(len(x)) if seeds is None else np.asarray(seeds, dtype=float)
        xc = x - x.mean()
        w = float((xc ** 2 / m).sum() / (xc @ xc) ** 2)
        ci = _widened(float(b), ci[0], ci[1], seed_sd, seed_df, w)
        out["se_seed"], out["seed_df"] = round(seed_sd * math.sqrt(w), 5), seed_df
        out["judged_against"] = ["evaluation", "training seeds"]
    out["ci95"] = [round(ci[0], 4), round(ci[1], 4)]
    if len(x) > 2:
        resid = tau - (a + b * x)
        se_fit = math.sqrt(float(resid @ resid) / (len(x) - 2) / float((x - x.mean()) @ (x - x.mean())))
        half = t975(len(x) - 2) * se_fit
        out["ci95_fit"] = [round(float(b) - half, 4), round(float(b) + half, 4)]
    else:
        out["ci95_fit"] = None
    return out


# per-prompt counts of each τ (value/<variant>/per_prompt.jsonl): kind, accepted drafts, verification steps
KINDS = (("engine", "engine_accepted", "engine_steps"), ("offline", "offline_accepted", "anchors"))


def _pooled(counts: Sequence[tuple[float, float] | None]) -> float | None:
    """τ pooled over prompts' (accepted, steps or anchors); None where a prompt was not measured, or none was."""
    if not counts or None in counts or not sum(n for _, n in counts):  # type: ignore[misc]
        return None
    return 1 + sum(a for a, _ in counts) / sum(n for _, n in counts)  # type: ignore[misc]


def counts_of(rows: Sequence[dict[str, Any]], num: str, den: str) -> list[tuple[float, float] | None]:
    """Each prompt's (accepted, steps or anchors) from per_prompt.jsonl's fields `num` and `den` (a `KINDS` pair),
    None where it was not measured."""
    return [None if p[num] is None else (p[num], p[den]) for p in rows]


def counts_at(rows: Sequence[dict[str, Any]], kind: str, t: str) -> list[tuple[float, float] | None]:
    """Each prompt's (accepted, steps or anchors) at temperature key `t` (per_prompt.jsonl's `*_by_temperature`),
    None where it was not measured."""
    out: list[tuple[float, float] | None] = []
    for p in rows:
        if kind == "offline":
            a = (p.get("offline_accepted_by_temperature") or {}).get(t)
            n = (p.get("offline_anchors_by_temperature") or {}).get(t, p["anchors"])  # its own continuation's
            out.append(None if a is None else (a, n))
        else:
            e = (p.get("engine_by_temperature") or {}).get(t)
            out.append(None if not e or e.get("steps") is None else (e["accepted"], e["steps"]))
    return out


def seed_spreads(runs: Sequence[dict[str, Any]], rows: Sequence[Sequence[dict[str, Any]]],
                 seeds: Sequence[int], temperatures: Sequence[str] = ()) -> dict[str, Any] | None:
    """exact's τ over its training `seeds` (`runs`: one result each, train.seed's first; `rows`: their per-prompt
    counts), engine and offline: per evaluation set (`per_dataset`, `seed_spread` of the per-set τ) and pooled over
    every prompt (`pooled`, what a Δτ to exact is judged against; `pooled_by_temperature`: the same at each
    temperature key of `temperatures`, what a Δτ at that temperature is judged against); None with fewer than two
    seeds."""
    if len(runs) < 2:
        return None
    per_ds = {ds: {kind: seed_spread([r["per_dataset"][ds][f"tau_{kind}"] for r in runs]) for kind, _, _ in KINDS}
              for ds in runs[0]["per_dataset"]}
    return {"seeds": list(seeds), "per_dataset": per_ds,
            "pooled": {kind: seed_spread([_pooled(counts_of(pp, num, den)) for pp in rows]) for kind, num, den in KINDS},
            "pooled_by_temperature": {t: {kind: seed_spread([_pooled(counts_at(pp, kind, t)) for pp in rows])
                                          for kind, _, _ in KINDS} for t in temperatures},
            "runs": [{"seed": s, "draft_dir": r["draft_dir"],
                      "per_dataset": {ds: {k: f.get(k) for k in ("tau_engine", "tau_engine_ci95", "tau_offline",
                                                                 "tau_offline_ci95", "offline_by_temperature")}
                                      for ds, f in r["per_dataset"].items()}} for s, r in zip(seeds, runs)]}


def size_curve(points: Sequence[tuple[str, int, Sequence[Sequence[dict[str, Any]]]]], seed: int = 0,
               spread: dict[str, Any] | None = None) -> dict[str, Any]:
    """`size_slope` over variants that differ only in their training rows: `points` (variant, training tokens, its
    per-prompt counts per seed: a point over several seeds pools each prompt's counts), engine τ where every point
    has it, else offline; `spread`: the pooled seed spread (`seed_spreads`), its σ taken to hold at every size."""
    kind, num, den = next(k for k in KINDS if all(p[k[1]] is not None for _, _, rs in points for r in rs for p in r))
    counts = [[(sum(r[i][num] for r in rs), sum(r[i][den] for r in rs)) for i in range(len(rs[0]))]
              for _, _, rs in points]
    sd = (spread or {}).get(kind) or {}
    out = size_slope([t for _, t, _ in points], counts, seed, sd.get("sd"),
                     sd["seeds"] - 1 if sd.get("sd") is not None else None, [len(rs) for _, _, rs in points])
    return {"variants": [v for v, _, _ in points], "tau": kind} | out
