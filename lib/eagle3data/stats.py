"""Honest numbers from small counts: the Wilson interval and the rule-of-three bound, in one place."""

from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a rate k/n (sound at k=0 and k=n, unlike the normal one)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (0.0 if k == 0 else max(0.0, mid - half), 1.0 if k == n else min(1.0, mid + half))


def upper95(failed: int, n: int) -> float:
    """95 % upper bound on a failure rate: rule of three (3/n) at zero failures, else Wilson's upper end."""
    if n <= 0:
        return float("nan")
    if failed == 0:
        return min(1.0, 3.0 / n)
    return wilson_interval(failed, n)[1]
