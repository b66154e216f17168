"""Offline acceptance length: the draft against the target's own states at every output position.

For a sequence of ids (prompt + the target's greedy continuation) with the target's states (3 aux
layers + its pre-norm final state, captured by 04's one `Capture`) and the target's own next-token
argmax at every position, every output position is an *anchor*: the target has just emitted token
`x[t+1]` from its state at `t`, and the draft, given `(x[t+1], g[t])`, proposes K tokens in a chain.
Draft step k is right when its token (mapped to the target vocabulary by 05's `d2t`) is the target's
argmax there; a chain is accepted up to its first wrong step. Per anchor

    τ(t) = 1 + Σ_{k=1..K} [the first k drafts all right]

(speculators' `full_acc_k`, vLLM's accepted length with its bonus token). The chain is computed by
speculators' own TTT forward, teacher-forced: where the first k drafts are right, the fed tokens are
the draft's own, so the indicator is the real chain's (a brute-force loop over truncated inputs,
`tests/test_value.py`, checks that). Unlike speculators' training metric, rightness is judged over the
**full** target vocabulary: a target token outside the draft vocabulary is a miss, as in serving.

Offline vs engine: offline takes every output position as an anchor and always goes K deep; the
engine only drafts from the positions its verification rounds land on (after an accepted run, the
next anchor is the bonus token). Both estimate the same chain acceptance; they differ in which anchors
are weighed, so offline and engine τ agree on average, not per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from eagle3data.hidden.capture import Capture, decoder_of


@dataclass
class EvalSeq:
    """One evaluation prompt with its reference continuation and the target's states over both."""

    dataset: str
    sample_id: str
    prompt_len: int
    input_ids: list[int]
    aux: Any = None          # [n, 3, H] float
    pre_norm: Any = None     # [n, H]
    target_next: Any = None  # [n] int64: the target's argmax after each position


@dataclass
class OfflineTau:
    anchors: int
    accepted: list[int] = field(default_factory=list)   # per anchor: drafts accepted (0..K)

    @property
    def tau(self) -> float | None:
        return 1.0 + sum(self.accepted) / len(self.accepted) if self.accepted else None


def chain_correct(draft: Any, seq: EvalSeq, K: int, d2t: Any) -> Any:
    """[anchors, K] bool: draft step k at anchor t is the target's argmax (full vocabulary), by the TTT forward.

    Anchors are t = prompt_len-1 .. n-2-K (x[t+1] is an output token; all K predicted tokens exist)."""
    import torch

    n, P = len(seq.input_ids), seq.prompt_len
    ids = torch.as_tensor(seq.input_ids, dtype=torch.long)
    first, last = P - 1, n - 2 - K
    if last < first:
        return torch.zeros(0, K, dtype=torch.bool)
    hs = seq.aux.float().flatten(1)  # [n, 3H]
    with torch.no_grad():
        toks = draft(hidden_states=hs[:-1][None], input_ids=ids[1:][None],
                     document_ids=torch.zeros(1, n - 1, dtype=torch.long),
                     position_ids=torch.arange(1, n, dtype=torch.long)[None], ttt_steps=K)
    t = torch.arange(first, last + 1)
    out = torch.zeros(len(t), K, dtype=torch.bool)
    tn = torch.as_tensor(seq.target_next, dtype=torch.long)
    for k in range(K):
        d = toks[k][0, t]                        # shifted position t <-> anchor t (input x[t+1], state g[t])
        pred = d + d2t[d]                        # draft vocab -> target vocab
        out[:, k] = pred == tn[t + 1 + k]        # predicts x[t+2+k]: the target's argmax at position t+1+k
    return out


def accepted_per_anchor(correct: Any) -> list[int]:
    """Leading run of right drafts per anchor (the chain stops at its first miss)."""
    import torch

    if correct.numel() == 0:
        return []
    return torch.cumprod(correct.to(torch.int64), dim=1).sum(dim=1).tolist()


def offline_tau(draft: Any, seq: EvalSeq, K: int, d2t: Any) -> OfflineTau:
    acc = accepted_per_anchor(chain_correct(draft, seq, K, d2t))
    return OfflineTau(len(acc), acc)


def per_position(taus: Sequence[OfflineTau], K: int) -> list[float | None]:
    """P(the first k drafts all right), k = 1..K, pooled over the anchors of all prompts."""
    acc = [a for t in taus for a in t.accepted]
    return [round(sum(a >= k for a in acc) / len(acc), 4) if acc else None for k in range(1, K + 1)]


def target_states(model: Any, layers: Any, seqs: Sequence[EvalSeq]) -> None:
    """Fill each sequence's aux, pre-norm state and the target's argmax by 04's own Capture (fp32, one at a time)."""
    import torch


    dec = decoder_of(model)
    head = model.get_output_embeddings()
    with Capture(model, layers, torch.float32, final_state="pre_norm") as cap:
        for s in seqs:
            st = cap.run(torch.as_tensor([s.input_ids], dtype=torch.long))[0]  # [n, 4, H]
            s.aux, s.pre_norm = st[:, :3].clone(), st[:, 3].clone()
            with torch.inference_mode():
                s.target_next = head(dec.norm(s.pre_norm.to(head.weight.dtype))).argmax(-1).cpu()
