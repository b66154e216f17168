"""Offline acceptance length at a sampling temperature T ≥ 0: speculative sampling's acceptance, chained.

At one draft step, with the target's distribution p and the draft's q (both at temperature T: softmax of the
logits / T; at T = 0 a point mass on the argmax), speculative sampling (Leviathan et al., Chen et al.) draws
the draft token d ~ q and keeps it with probability min(1, p(d)/q(d)); on a rejection it draws from
norm(max(0, p − q)), so the output is p's exactly. The step is accepted with probability

    α = Σ_x min(p_T(x), q_T(x)).

**The draft's vocabulary**: the draft scores its own `draft_vocab_size` tokens; draft index i is target
token `i + d2t[i]` (05's map, injective). q is zero on every target token outside that set, so
α = Σ_i min(p_T(i + d2t[i]), q_T(i)): a target token the draft cannot name never counts, as in serving.

**The chain**, per anchor t (as `offline.py`: every output position, K deep, the draft given
`(x[t+1], g[t])`): step k's p is the target's at position t+k (it predicts `x[t+k+1]`) and q the draft's
k-th TTT step, both **teacher-forced on the data's tokens**: the context of step k is the prompt and the
reference continuation up to `x[t+k]`, the draft's own states rolled forward (speculators' TTT forward).
The expected tokens per verification step are then

    τ(t) = 1 + Σ_{k=1..K} Π_{j≤k} α_j,

i.e. P(the first k drafts all accepted) = Π_{j≤k} α_j, each step's α taken on the data's context. This is
speculative sampling's expectation exactly when a step's p and q do not depend on which token the earlier
steps accepted, and at T = 0 on the target's greedy output (the accepted token is then the data's own, and
α_k is the indicator `d2t-mapped argmax q == argmax p`: the figure is `offline.offline_tau`'s, bit for bit).
At T > 0 the real chain goes on from the token it accepted (distributed as min(p, q)/α), not from the data's:
the figure is speculative sampling's acceptance along the reference continuation's contexts, which is what
the engine's counters measure on average when the continuations are typical of what it samples. So 06 takes
τ at T along continuations the target itself sampled at T (`offline_by_temperature`'s `at`: a seeded plain
server pass per T); along the greedy ones it overstates τ at T = 1 (measured in docs/06: 0.05 and 0.18).

**Which draft distribution**: `draft_temperature=None` samples the draft at T too (the formula above, the
EAGLE papers' speculative sampling). vLLM's v1 EAGLE proposer always drafts by argmax (vLLM PR #16899) and
its rejection sampler treats the draft as a point mass (`draft_probs=None`): a step is then accepted with
probability p_T(d), d the draft's argmax mapped to the target vocabulary — `draft_temperature=0` here. That
is the figure to hold against vLLM's engine τ at T > 0 (top-k/top-p are not modelled: the target's
distribution is the plain tempered softmax). Both agree at T = 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from eagle3data.hidden.capture import decoder_of
from eagle3data.value.offline import EvalSeq, offline_tau
from eagle3data.value.spread import ratio_ci
from eagle3data.value.train import ValueStageError


def tempered(logits: Any, temperature: float) -> Any:
    """Probabilities at a temperature over the last dimension: softmax(logits / T); T = 0 a point mass on the argmax
    (torch's argmax: the first of tied maxima, as the greedy figure takes it)."""
    import torch

    if temperature < 0:
        raise ValueError(f"temperature {temperature} < 0")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least (fp64 stays)
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.softmax(logits / temperature, dim=-1)


def draft_target_ids(d2t: Any, target_vocab: int) -> Any:
    """[draft_vocab] int64: the target token of each draft index (`i + d2t[i]`), checked in range and one-to-one."""
    import torch

    d2t = torch.as_tensor(d2t, dtype=torch.long)
    ids = torch.arange(len(d2t), dtype=torch.long) + d2t
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab):
        raise ValueError(f"d2t maps draft tokens outside the target vocabulary of {target_vocab}")
    if len(torch.unique(ids)) != len(ids):
        raise ValueError("d2t maps two draft tokens to one target token")
    return ids


def step_acceptance(p: Any, q: Any, target_ids: Any) -> Any:
    """α = Σ_x min(p(x), q(x)) over the last dimension: p [..., V] the target's probabilities, q [..., Vd] the draft's
    over its own vocabulary, `target_ids` [Vd] each draft index's target token (q is 0 on every other token)."""
    import torch

    return torch.minimum(p[..., target_ids], q).sum(-1).clamp_(0.0, 1.0)


def chain_expectation(alpha: Any) -> Any:
    """[...] expected accepted drafts: Σ_k Π_{j≤k} α_j over the last dimension (τ is 1 + this)."""
    return alpha.double().cumprod(-1).sum(-1)


@dataclass
class SampledTau:
    """One sequence's offline figure at one temperature: α per anchor and draft step."""

    temperature: float
    alpha: Any  # [anchors, K] float: step k accepted with this probability (teacher-forced context)

    @property
    def anchors(self) -> int:
        return int(self.alpha.shape[0])

    @property
    def accepted(self) -> list[float]:
        """Expected accepted drafts per anchor (0..K; integers at T = 0)."""
        return chain_expectation(self.alpha).tolist()

    @property
    def tau(self) -> float | None:
        acc = self.accepted
        return 1.0 + sum(acc) / len(acc) if acc else None


def target_head_of(model: Any) -> Callable[[Any], Any]:
    """pre-norm final states [n, H] -> the target's logits [n, V] (fp32), as `offline.target_states` computes its
    argmax; holds only the final norm and the head, so the model itself can be freed."""
    import torch

    norm, head = decoder_of(model).norm, model.get_output_embeddings()

    def logits(pre_norm: Any) -> Any:
        with torch.inference_mode():
            return head(norm(pre_norm.to(head.weight.dtype))).float()

    return logits


def _draft_logits(draft: Any, seq: EvalSeq, K: int) -> list[Any]:
    """The draft's logits [n-1, Vd] at each of its K TTT steps (speculators' own forward, its head's outputs)."""
    import torch

    n = len(seq.input_ids)
    ids = torch.as_tensor(seq.input_ids, dtype=torch.long)
    hs = seq.aux.float().flatten(1)
    seen: list[Any] = []
    hook = draft.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()[0].float()))
    try:
        with torch.no_grad():
            draft(hidden_states=hs[:-1][None], input_ids=ids[1:][None],
                  document_ids=torch.zeros(1, n - 1, dtype=torch.long),
                  position_ids=torch.arange(1, n, dtype=torch.long)[None], ttt_steps=K)
    finally:
        hook.remove()
    if len(seen) != K:
        raise RuntimeError(f"the draft's head ran {len(seen)} times in a {K}-step TTT forward")
    return seen


def sampled_taus(draft: Any, seq: EvalSeq, K: int, d2t: Any, target_head: Callable[[Any], Any],
                 temperatures: Sequence[float], draft_temperature: float | None = None) -> list[SampledTau]:
    """One sequence's α [anchors, K] at each temperature, from one TTT forward of the draft and the target's logits
    (`target_head(seq.pre_norm)`); anchors as `offline.chain_correct` (t = prompt_len-1 .. n-2-K).
    `draft_temperature`: None samples the draft at each T (Σ min(p_T, q_T)); 0 drafts by argmax as vLLM does."""
    import torch

    n, P = len(seq.input_ids), seq.prompt_len
    first, last = P - 1, n - 2 - K
    if last < first:
        return [SampledTau(T, torch.zeros(0, K, dtype=torch.float64)) for T in temperatures]
    t = torch.arange(first, last + 1)
    q_logits = [lg[t] for lg in _draft_logits(draft, seq, K)]                # step k at anchor t: [A, Vd]
    p_logits = target_head(seq.pre_norm)[first + 1:last + K + 1]               # rows t+1+k for all t, k
    ids = draft_target_ids(d2t, p_logits.shape[-1])
    out = []
    for T in temperatures:
        p_all = tempered(p_logits, T)
        qT = T if draft_temperature is None else draft_temperature
        alpha = torch.stack([step_acceptance(p_all[k:k + len(t)], tempered(q_logits[k], qT), ids)
                             for k in range(K)], dim=1)
        out.append(SampledTau(T, alpha.double()))
    return out


def sampled_positions(taus: Sequence[SampledTau], K: int) -> list[float | None]:
    """P(the first k drafts all accepted), k = 1..K, pooled over the anchors of all the sequences (one temperature):
    `offline.per_position`'s figure, with expectations in place of counts."""
    import torch

    rows = [s.alpha for s in taus if s.anchors]
    if not rows:
        return [None] * K
    return [round(float(v), 4) for v in torch.cat(rows).cumprod(-1).mean(0)]


def temperature_key(t: float) -> str:
    """A temperature as summary.json's keys spell it (`"0.0"`, `"1.0"`)."""
    return str(float(t))


def offline_by_temperature(draft: Any, seqs: Sequence[EvalSeq], head: Callable[[Any], Any], K: int,
                           temperatures: Sequence[float], seed: int = 0,
                           greedy: Sequence[Any] | None = None,
                           at: dict[float, Sequence[EvalSeq]] | None = None
                           ) -> tuple[list[dict[str, float]], list[dict[str, int]], dict[str, Any]]:
    """Offline τ at each temperature (the draft greedy, as vLLM's proposer drafts): per sequence
    {T: expected accepted drafts} and {T: anchors}, and per evaluation set {T: {tau, tau_ci95 (ratio_ci over
    prompts), per_position, along}}. `seqs`: the prompts with the target's greedy continuations; `at`: {T: the same
    prompts, in order, with the continuation the target sampled at T} — τ at T is then taken along those (`along`
    "sampled at T": the contexts the engine meets when it serves at T), else along the greedy ones (`along`
    "greedy", which overstates τ at T > 0: measured in docs/06). `greedy`: `offline.offline_tau` per sequence
    (computed here when not given), T = 0's figure. A T > 0 taken along the greedy continuations shares one sampled
    pass with T = 0, which must equal the greedy chain anchor for anchor (else ValueStageError)."""
    import torch

    greedy = greedy if greedy is not None else [offline_tau(draft, s, K, draft.d2t) for s in seqs]
    at = {float(T): v for T, v in (at or {}).items()}
    for T, own in at.items():
        if [(s.dataset, s.sample_id) for s in own] != [(s.dataset, s.sample_id) for s in seqs]:
            raise ValueStageError(f"offline τ at T = {T:g}: its continuations are not of the evaluation prompts")
    hot = [float(t) for t in temperatures if t and float(t) not in at]
    sampled = ([sampled_taus(draft, s, K, draft.d2t, head, [0.0] + hot, draft_temperature=0) for s in seqs]
               if hot else [[] for _ in seqs])
    bad = [s.sample_id for s, t, o in zip(seqs, sampled, greedy) if t and t[0].accepted != o.accepted]
    if bad:
        raise ValueStageError(f"offline τ at T = 0 differs from the greedy chain for {len(bad)} prompt(s) (first "
                              f"{bad[0]}): value/sampling.py and value/offline.py disagree")
    own_taus = {T: [sampled_taus(draft, s, K, draft.d2t, head, [T], draft_temperature=0)[0] for s in at[T]]
                for T in map(float, temperatures) if T in at and T}
    taus = []
    for i, (o, t) in enumerate(zip(greedy, sampled)):
        at0 = SampledTau(0.0, torch.tensor([[1.0] * a + [0.0] * (K - a) for a in o.accepted],
                                           dtype=torch.float64).reshape(-1, K))
        by = {x.temperature: x for x in t[1:]} | {0.0: at0} | {T: v[i] for T, v in own_taus.items()}
        taus.append([by[float(T)] for T in temperatures])
    per_prompt = [{temperature_key(x.temperature): round(sum(x.accepted), 4) for x in t} for t in taus]
    anchors = [{temperature_key(x.temperature): x.anchors for x in t} for t in taus]
    per_ds: dict[str, Any] = {}
    for ds in dict.fromkeys(s.dataset for s in seqs):
        idx = [i for i, s in enumerate(seqs) if s.dataset == ds]
        per_ds[ds] = {}
        for j, T in enumerate(temperatures):
            tau, ci = ratio_ci([sum(taus[i][j].accepted) for i in idx], [taus[i][j].anchors for i in idx], seed)
            per_ds[ds][temperature_key(T)] = {"tau": tau, "tau_ci95": ci,
                                              "per_position": sampled_positions([taus[i][j] for i in idx], K),
                                              "along": along_of(float(T), at)}
    return per_prompt, anchors, per_ds


def along_of(T: float, at: dict[float, Any] | None) -> str:
    """Which continuations offline τ at T is taken along: "greedy" (T = 0, or no sampled continuations given) or
    "sampled at T"."""
    return "sampled at T" if T and float(T) in (at or {}) else "greedy"
