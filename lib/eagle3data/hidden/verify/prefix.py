"""`shared_prefix`: two samples whose ids share a prefix have the same states over it (docs/04 "Shared prefixes").

A causal model's state at position t depends on the ids up to t only, so where two samples share their first c ids
(a system prompt, a template, the earlier turns of a conversation) their stored rows 0..c-1 are equal within the
capture's noise. `prompt_logit_z` draws its positions after the shared prefix (the states there cannot tell the two
samples apart), so rows overwritten inside it went unseen by the default pass; this check compares them.

During the pass each sample keeps the norms of every state at a few rows of its longest shared prefix (`kept_rows`:
multiples of a power-of-two stride, at most PREFIX_ROWS; a sample's rows include its partner's at the coarser of the
two strides). After the pass each pair of neighbours in id order (`prefix_pairs`) compares them; a row differs when
a state's norms differ by more than PREFIX_NORM_TOL (relative) for the target's compute dtype. Which sample differs
is decided by the target's head (`judge_pairs`): at the differing rows each sample's final state scores its own next
token (the logit z, `Head.logit_z`); a sample fails when its mean z is below MIN_PROMPT_Z and its partner's, at the
same rows, is higher by PREFIX_Z_GAP. Two clean samples whose rows differ by noise have the same z there: neither
fails.
"""

from __future__ import annotations

from typing import Any, Sequence

from eagle3data.hidden.verify.checks import MIN_PROMPT_Z, positions

PREFIX_ROWS = 32  # at most this many rows of a sample's shared prefix compared (cheap: their norms only)
# The relative difference of a row's norms (the largest over its states) beyond which two samples' shared rows
# differ, by the dtype the target computes in. Measured 2026-12-04 between the shared-prefix rows of clean samples
# (docs/04 "Shared prefixes"): float32 forwards at most 3.9e-5 (bf16 / int8 / FP8 storage, every layout), a bf16
# forward 0.021 (fp16 0); rows of other tokens at the same positions: median 0.19, the least 0.0055.
PREFIX_NORM_TOL = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.05}
PREFIX_Z_GAP = 1.0  # the partner's mean z at the same rows must exceed the failing sample's by this much


def prefix_pairs(ids: dict[Any, Sequence[int]]) -> list[tuple[Any, Any, int]]:
    """(key a, key b, c): each pair of neighbours in id order that share their first c > 0 ids. Sorting the ids
    puts the samples sharing the longest prefix next to each other (as `checks.unique_starts` does)."""
    import numpy as np

    arrs = {k: np.asarray(v, dtype=">i4") for k, v in ids.items()}
    order = sorted(arrs, key=lambda k: arrs[k].tobytes())
    out = []
    for a, b in zip(order, order[1:]):
        x, y = arrs[a], arrs[b]
        n = min(len(x), len(y))
        d = np.flatnonzero(x[:n] != y[:n])
        c = int(d[0]) if len(d) else n
        if c > 0:
            out.append((a, b, c))
    return out


def stride(c: int) -> int:
    """The power-of-two stride that keeps at most PREFIX_ROWS of `c` rows."""
    s = 1
    while -(-c // s) > PREFIX_ROWS:
        s *= 2
    return s


def kept_rows(pairs: Sequence[tuple[Any, Any, int]]) -> dict[Any, list[int]]:
    """Per sample with a partner: the rows whose norms the pass keeps (its longest shared prefix, strided)."""
    longest: dict[Any, int] = {}
    for a, b, c in pairs:
        longest[a], longest[b] = max(longest.get(a, 0), c), max(longest.get(b, 0), c)
    return {k: list(range(0, c, stride(c))) for k, c in longest.items()}


def row_norms(hs: Any, rows: Sequence[int]) -> Any:
    """The norms of every state at `rows` of one sample's states `[n, S, hidden]`: float32 `[len(rows), S]`."""
    import torch

    idx = torch.tensor(list(rows), dtype=torch.long)
    return torch.nan_to_num(torch.linalg.vector_norm(hs.index_select(0, idx).float(), dim=-1), nan=0.0, posinf=0.0)


def compare_pairs(pairs: Sequence[tuple[Any, Any, int]], kept: dict[Any, list[int]], norms: dict[Any, Any],
                  tol: float) -> dict[tuple[Any, Any], dict[str, Any]]:
    """Per pair whose norms were kept: the rows compared, those beyond `tol`, the largest relative difference."""
    import torch

    out = {}
    for a, b, c in pairs:
        if a not in norms or b not in norms:
            continue  # a sample the pass could not judge (wrong shape, a file that did not open)
        at_a, at_b = {r: i for i, r in enumerate(kept[a])}, {r: i for i, r in enumerate(kept[b])}
        rows = sorted(r for r in at_a.keys() & at_b.keys() if r < c)  # the multiples of the coarser stride below c
        na, nb = norms[a][[at_a[r] for r in rows]], norms[b][[at_b[r] for r in rows]]
        rel = ((na - nb).abs() / torch.maximum(na, nb).clamp_min(1e-30)).amax(-1)
        out[(a, b)] = {"rows": rows, "differ": [r for r, v in zip(rows, rel.tolist()) if v > tol],
                       "max_rel": float(rel.max()) if len(rows) else 0.0}
    return out


def prefix_z(head: Any, hs: Any, ids: Any, names: Sequence[str], rows: Sequence[int]) -> float:
    """The mean logit z of one sample's own next tokens at `rows` (each below its last row), from its final state."""
    import torch

    rows = [r for r in rows if r + 1 < len(ids)]
    if not rows:
        return float("nan")
    idx = torch.tensor(rows, dtype=torch.long)
    x = torch.nan_to_num(hs.index_select(0, idx).float(), nan=0.0, posinf=0.0, neginf=0.0)
    post = x[:, names.index("post_norm")] if "post_norm" in names else head.norm(x[:, names.index("pre_norm")])
    return float(head.logit_z(post, ids[idx + 1]).mean())


def judge_pairs(compared: dict[tuple[Any, Any], dict[str, Any]], read: Any, head: Any, names: Sequence[str],
                k: int) -> dict[Any, dict[str, Any]]:
    """Per sample of a pair whose rows differ: its mean z and its partner's at up to `k` of the differing rows
    (`read(key)` gives its states and ids), and whether it fails (below MIN_PROMPT_Z, the partner PREFIX_Z_GAP
    higher)."""
    out: dict[Any, dict[str, Any]] = {}
    for (a, b), cmp in compared.items():
        if not cmp["differ"]:
            continue
        rows = positions(f"{a}|{b}", cmp["differ"], k)
        (ha, ia), (hb, ib) = read(a), read(b)
        za, zb = prefix_z(head, ha, ia, names, rows), prefix_z(head, hb, ib, names, rows)
        for key, mine, other, partner in ((a, za, zb, b), (b, zb, za, a)):
            fails = mine < MIN_PROMPT_Z and other - mine >= PREFIX_Z_GAP
            got = out.setdefault(key, {"failed": False, "against": []})
            got["against"].append({"partner": str(partner), "rows": len(rows), "z": round(mine, 3),
                                   "partner_z": round(other, 3)})
            got["failed"] = got["failed"] or fails
    return out
