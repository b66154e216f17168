"""Honest numbers from small counts: the Wilson interval, the rule-of-three bound and the calibrated
count offset, in one place."""

from __future__ import annotations

import math
from typing import Any

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


def upper95_text(check: dict[str, Any]) -> str:
    """A check's 95% bound (`upper95` of a summary's check) as shown: a percentage, or "" where it has none
    (nothing applicable; verify-hidden's store-level coverage check, whose rate over one store says nothing)."""
    v = check.get("upper95")
    return "" if v is None or v != v else f"{v:.2%}"


def mode_share(values: list[int]) -> tuple[int | None, float]:
    """The most common value (the smallest in size on a tie) and its share, or (None, 0.0) when empty."""
    if not values:
        return None, 0.0
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    best = min(counts, key=lambda v: (-counts[v], abs(v), v))
    return best, counts[best] / len(values)


def calibrated_offset(diffs: list[int], *, min_records: int, min_share: float, max_offset: int
                      ) -> tuple[int, bool, int | None, float]:
    """How a provider's billed token counts relate to ours, learned from a group's records (one rule for
    02's completion counts and 03's prompt counts): the most common difference is the group's offset when
    at least `min_records` records have one, it holds for at least `min_share` of them and
    `|offset| <= max_offset`; otherwise the offset is 0 (billed must equal ours).
    Returns (offset, calibrated, mode, mode's share)."""
    mode, share = mode_share(diffs)
    ok = mode is not None and len(diffs) >= min_records and share >= min_share and abs(mode) <= max_offset
    return (int(mode) if ok else 0), ok, mode, share  # type: ignore[arg-type]
