"""Stage 06's noise figures (value/spread.py) on synthetic inputs with known truths: the seed spread, a Δτ judged
against evaluation and training-seed noise (its interval covers a true zero ~95% of the time when both noises are
present, far less when the seed noise is ignored), and the slope per doubling of training tokens (recovered, its
intervals covering the true slope at their nominal rate)."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3data.core.params.value import ValueParams
from eagle3data.value.spread import judge_diff, seed_spread, size_slope, t975


def test_students_quantile_is_the_tables():
    for df, t in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)):
        assert t975(df) == pytest.approx(t, abs=1e-4)
    assert t975(float("inf")) == pytest.approx(1.95996, abs=1e-5) and t975(1e6) == pytest.approx(1.95996, abs=1e-4)


def test_seed_spread_recovers_known_values():
    assert seed_spread([1.20, 1.22, 1.24]) == {"seeds": 3, "mean": 1.22, "sd": 0.02, "min": 1.2, "max": 1.24}
    assert seed_spread([1.3])["sd"] is None and seed_spread([])["mean"] is None
    rng = np.random.default_rng(0)
    s = seed_spread(list(1.5 + 0.03 * rng.standard_normal(4000)))
    assert s["mean"] == pytest.approx(1.5, abs=0.003) and s["sd"] == pytest.approx(0.03, rel=0.05)


def _coverage(sims: int, sigma_seed: float, se_eval: float, seeds: int, use_seed: bool, rng) -> float:
    """How often the rule's interval holds the true Δτ = 0: two variants of the same worth, `seeds` seeds each."""
    hits = 0
    for _ in range(sims):
        a = sigma_seed * rng.standard_normal(seeds)
        b = sigma_seed * rng.standard_normal(seeds)
        d = b.mean() - a.mean() + se_eval * rng.standard_normal()
        ev = [d - 1.96 * se_eval, d + 1.96 * se_eval]
        j = (judge_diff(d, ev, float(a.std(ddof=1)), seeds - 1, seeds, seeds) if use_seed
             else judge_diff(d, ev))
        hits += j["ci95"][0] <= 0 <= j["ci95"][1]
    return hits / sims


def test_a_diff_judged_against_both_noises_covers_a_true_zero_at_its_nominal_rate():
    rng = np.random.default_rng(1)
    for sigma, se in ((0.02, 0.01), (0.02, 0.002), (0.005, 0.01)):   # both noises, seed noise ruling, eval ruling
        assert 0.935 <= _coverage(2000, sigma, se, 3, True, rng) <= 0.985
    assert _coverage(1000, 0.02, 0.01, 3, False, rng) < 0.8   # evaluation noise alone: ~70%, far too sure


def test_a_diff_significant_on_evaluation_noise_alone_is_not_with_a_large_seed_spread():
    alone = judge_diff(0.03, [0.015, 0.045])
    assert alone["significant"] and alone["ci95"] == [0.015, 0.045] and alone["judged_against"] == ["evaluation"]
    tight = judge_diff(0.03, [0.015, 0.045], seed_sd=1e-9, seed_df=2)
    assert tight["ci95"] == pytest.approx([0.015, 0.045], abs=2e-4) and tight["significant"]
    wide = judge_diff(0.03, [0.015, 0.045], seed_sd=0.02, seed_df=2, seeds_a=3, seeds_b=1)
    assert not wide["significant"] and wide["ci95"][0] < 0 < wide["ci95"][1]
    assert wide["se_seed"] == pytest.approx(0.02 * np.sqrt(1 / 3 + 1), abs=1e-5) and wide["seed_df"] == 2
    h = 4.3027 * 0.02 * np.sqrt(1 / 3 + 1)                      # the seed term's own half-width, t(0.975, 2)
    assert wide["ci95"] == pytest.approx([0.03 - np.hypot(0.015, h), 0.03 + np.hypot(0.015, h)], abs=2e-4)


def _points(rng, tokens, tau, prompts=200, steps=100, spread=0.3):
    """Per prompt (accepted, steps) with prompt difficulty shared across points: pooled τ_i ≈ tau[i]."""
    hard = spread * rng.standard_normal(prompts)
    return [[(max(0.0, (t - 1) * steps * (1 + h) + rng.normal(0, 3)), steps) for h in hard] for t in tau]


def test_a_known_slope_per_doubling_is_recovered():
    tokens = [20_000, 40_000, 80_000, 160_000]
    exact = size_slope(tokens, [[((1.2 + 0.05 * i - 1) * 100, 100)] * 10 for i in range(4)])
    assert exact["slope_per_doubling"] == pytest.approx(0.05, abs=1e-9)
    assert exact["ci95"] == pytest.approx([0.05, 0.05], abs=1e-9) and exact["ci95_fit"] == pytest.approx([0.05, 0.05])
    assert [p["tau"] for p in exact["points"]] == pytest.approx([1.2, 1.25, 1.3, 1.35])
    rng = np.random.default_rng(2)
    noisy = size_slope(tokens, _points(rng, tokens, [1.2 + 0.05 * i for i in range(4)]))
    assert noisy["slope_per_doubling"] == pytest.approx(0.05, abs=0.01)
    assert noisy["ci95"][0] < 0.05 < noisy["ci95"][1] and noisy["judged_against"] == ["evaluation"]
    with pytest.raises(ValueError):
        size_slope([1000, 1000], [[(1, 1)], [(1, 1)]])


def test_the_slopes_bootstrap_interval_covers_the_truth_at_its_nominal_rate():
    """Evaluation noise only (one training run per point, no seed noise): the paired bootstrap over prompts."""
    rng = np.random.default_rng(3)
    tokens = [10_000, 20_000, 40_000, 80_000]
    covered = 0
    sims = 300
    for s in range(sims):
        r = size_slope(tokens, _points(rng, tokens, [1.1 + 0.04 * i for i in range(4)], prompts=80), seed=s,
                       resamples=400)
        covered += r["ci95"][0] <= 0.04 <= r["ci95"][1]
    assert 0.89 <= covered / sims <= 0.99


def test_the_slope_with_seed_noise_widens_and_covers_and_the_fit_interval_sees_scatter():
    """Each point one training run whose τ is off by N(0, σ²): the combined interval covers the true slope ~95%;
    the bootstrap alone does not; the regression's own t-interval (df = points − 2) also covers it."""
    rng = np.random.default_rng(4)
    tokens = [10_000, 20_000, 40_000, 80_000, 160_000]
    sigma = 0.02
    both = alone = fit = 0
    sims = 300
    for s in range(sims):
        tau = [1.1 + 0.04 * i + sigma * rng.standard_normal() for i in range(5)]
        pts = _points(rng, tokens, tau, prompts=60)
        seeds = 1.3 + sigma * rng.standard_normal(3)               # σ measured on 3 seeds of one point
        r = size_slope(tokens, pts, seed=s, seed_sd=float(seeds.std(ddof=1)), seed_df=2, resamples=300)
        e = size_slope(tokens, pts, seed=s, resamples=300)
        both += r["ci95"][0] <= 0.04 <= r["ci95"][1]
        alone += e["ci95"][0] <= 0.04 <= e["ci95"][1]
        fit += r["ci95_fit"][0] <= 0.04 <= r["ci95_fit"][1]
    assert 0.9 <= both / sims <= 0.995 and alone / sims < 0.85 and 0.9 <= fit / sims <= 0.99
    assert r["judged_against"] == ["evaluation", "training seeds"] and r["se_seed"] > 0


def test_params_take_distinct_seeds():
    assert ValueParams().train.seeds is None
    assert ValueParams(train={"seeds": [0, 1, 2]}).train.seeds == [0, 1, 2]
    for bad in ([], [1, 1]):
        with pytest.raises(ValueError):
            ValueParams(train={"seeds": bad})
