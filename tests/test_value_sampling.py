"""Stage 06 at T > 0: the offline acceptance by speculative sampling (value/sampling.py).

The chained figure equals an exact enumeration of the speculative-sampling algorithm itself (every draft path,
acceptance test and residual draw) on a tiny vocabulary with a draft vocabulary smaller than the target's; an
oracle draft scores K + 1 at any temperature, a draft with no mass on the target's tokens scores 1, T → 0 is the
greedy chain; and on speculators' own Eagle3DraftModel (a tiny random one) the T = 0 figure is `offline.py`'s.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from eagle3data.core.params.value import ValueParams
from eagle3data.value.offline import EvalSeq, accepted_per_anchor, chain_correct
from eagle3data.value.sampling import (SampledTau, chain_expectation, draft_target_ids, sampled_positions,
                                       sampled_taus, step_acceptance, target_head_of, tempered)

V, VD = 4, 3
D2T = torch.tensor([0, 1, 1])  # draft index 0, 1, 2 -> target token 0, 2, 3 (target token 1 is not in the draft)
IDS = draft_target_ids(D2T, V)


def _spec_sampling(p_of, q_of, K: int) -> tuple[float, torch.Tensor]:
    """Speculative sampling enumerated exactly: the draft samples d_1..d_K from q (over its own vocabulary, each step
    given its own earlier tokens); the target keeps d_j with probability min(1, p_j(x_j)/q_j(x_j)) (x_j its target
    token), stops at the first rejection and draws from norm(max(0, p_j − q_j)). Returns E[accepted drafts] and the
    distribution of the first token emitted (speculation is lossless: it must be p_1)."""
    expected, first = 0.0, torch.zeros(V, dtype=torch.float64)
    for path in itertools.product(range(VD), repeat=K):
        prob, prefix, qs = 1.0, (), []
        for d in path:
            q = q_of(prefix)
            prob *= float(q[d])
            qs.append(q)
            prefix += (int(IDS[d]),)
        if prob == 0:
            continue
        keep, prefix = 1.0, ()
        for j, d in enumerate(path):
            p, q = p_of(prefix), qs[j]
            x = int(IDS[d])
            a = min(1.0, float(p[x] / q[d]))
            if j == 0:
                qt = torch.zeros(V, dtype=torch.float64)
                qt[IDS] = q
                resid = (p - qt).clamp(min=0)
                first += prob * (a * torch.nn.functional.one_hot(torch.tensor(x), V) +
                                 (1 - a) * (resid / resid.sum() if resid.sum() > 0 else resid))
            keep *= a
            expected += prob * keep   # P(the first j+1 drafts all kept | this draft path)
            prefix += (x,)
    return expected, first


def _logits(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * 2


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("T", [0.3, 1.0, 2.5])
def test_the_chain_equals_an_exact_enumeration_of_speculative_sampling(K, T):
    """Step distributions that depend on the step only: the product of Σ min(p_T, q_T) is the algorithm's exact
    expectation (and the enumerator's first token is p's: it is the lossless algorithm)."""
    gen = torch.Generator().manual_seed(K * 10 + int(T * 10))
    for _ in range(5):
        P, Q = _logits(K, V, gen=gen), _logits(K, VD, gen=gen)
        p, q = tempered(P, T).double(), tempered(Q, T).double()
        exact, first = _spec_sampling(lambda pre: p[len(pre)], lambda pre: q[len(pre)], K)
        assert torch.allclose(first, p[0], atol=1e-12)
        ours = float(chain_expectation(step_acceptance(p, q, IDS)))
        assert ours == pytest.approx(exact, abs=1e-12)
        assert 0 < ours < K


@pytest.mark.parametrize("T", [0.5, 1.0])
def test_greedy_drafts_as_vllm_proposes_them_are_accepted_with_the_targets_probability(T):
    """vLLM drafts by argmax (a point mass q): the enumeration of that algorithm equals `draft_temperature=0`'s α."""
    gen = torch.Generator().manual_seed(7)
    K = 3
    P, Q = _logits(K, V, gen=gen), _logits(K, VD, gen=gen)
    p, q0 = tempered(P, T).double(), tempered(Q, 0).double()
    exact, _ = _spec_sampling(lambda pre: p[len(pre)], lambda pre: q0[len(pre)], K)
    alpha = step_acceptance(p, q0, IDS)
    assert torch.allclose(alpha, p[torch.arange(K), IDS[Q.argmax(-1)]])
    assert float(chain_expectation(alpha)) == pytest.approx(exact, abs=1e-12)


def test_at_t0_on_greedy_data_the_teacher_forced_chain_is_exact_with_context_dependent_models():
    """At T = 0 the accepted token is the data's (the target's argmax): feeding the data's tokens is the real chain,
    however the distributions depend on the context."""
    K = 3
    gen = torch.Generator().manual_seed(3)
    tp, tq = {}, {}

    def table(store, prefix, n):
        if prefix not in store:
            store[prefix] = _logits(n, gen=gen)
        return store[prefix]

    for _ in range(20):
        tp.clear(), tq.clear()
        p_of = lambda pre: tempered(table(tp, pre, V), 0).double()  # noqa: E731
        q_of = lambda pre: tempered(table(tq, pre, VD), 0).double()  # noqa: E731
        exact, _ = _spec_sampling(p_of, q_of, K)
        data: tuple[int, ...] = ()
        for _k in range(K):
            data += (int(p_of(data).argmax()),)   # the target's greedy continuation
        p = torch.stack([p_of(data[:k]) for k in range(K)])
        q = torch.stack([q_of(data[:k]) for k in range(K)])
        assert float(chain_expectation(step_acceptance(p, q, IDS))) == exact


@pytest.mark.parametrize("T", [0.0, 0.2, 1.0, 3.0])
def test_an_oracle_draft_scores_k_plus_one_and_a_draft_without_the_targets_tokens_scores_one(T):
    gen = torch.Generator().manual_seed(11)
    K, A = 3, 6
    P = _logits(A, K, V, gen=gen)
    same = torch.zeros(V, dtype=torch.long)                     # a draft vocabulary equal to the target's
    oracle = chain_expectation(step_acceptance(tempered(P, T), tempered(P, T), draft_target_ids(same, V)))
    assert torch.allclose(oracle, torch.full((A,), float(K), dtype=torch.float64))
    Pin = P.clone()
    Pin[..., 1] = float("-inf")                                  # the target only says what the small draft can name
    small = chain_expectation(step_acceptance(tempered(Pin, T), tempered(Pin[..., IDS], T), IDS))
    assert torch.allclose(small, torch.full((A,), float(K), dtype=torch.float64))
    Pout = P.clone()
    Pout[..., IDS] = float("-inf")                               # the target never says what the draft can name
    none = chain_expectation(step_acceptance(tempered(Pout, T), tempered(_logits(A, K, VD, gen=gen), T), IDS))
    assert torch.equal(none, torch.zeros(A, dtype=torch.float64))
    assert SampledTau(T, step_acceptance(tempered(Pout, T), tempered(P[..., IDS], T), IDS)).tau == 1.0


def test_t_to_0_is_the_greedy_chain():
    gen = torch.Generator().manual_seed(5)
    K, A = 3, 50
    P = torch.stack([torch.randperm(V, generator=gen).double() for _ in range(A * K)]).view(A, K, V)  # gaps ≥ 1
    Q = torch.stack([torch.randperm(VD, generator=gen).double() for _ in range(A * K)]).view(A, K, VD)
    P[:, :, 0] += 10 * (torch.rand(A, K, generator=gen) < 0.6)        # the draft's top (index 2 -> token 3) often right
    Q[:, :, 2] += 10 * (torch.rand(A, K, generator=gen) < 0.8)
    P[:, :, 3] += 10 * (Q.argmax(-1) == 2) * (torch.rand(A, K, generator=gen) < 0.7)
    correct = IDS[Q.argmax(-1)] == P.argmax(-1)
    greedy = torch.tensor(accepted_per_anchor(correct), dtype=torch.float64)
    assert 0 < greedy.mean() < K
    assert torch.equal(chain_expectation(step_acceptance(tempered(P, 0), tempered(Q, 0), IDS)), greedy)
    near = chain_expectation(step_acceptance(tempered(P, 1e-3), tempered(Q, 1e-3), IDS))
    assert torch.allclose(near, greedy, atol=1e-9)
    hot = chain_expectation(step_acceptance(tempered(P, 1.0), tempered(Q, 1.0), IDS))
    assert not torch.allclose(hot, greedy, atol=1e-3)


def test_a_bad_vocabulary_map_and_a_negative_temperature_are_refused():
    with pytest.raises(ValueError, match="outside"):
        draft_target_ids(torch.tensor([0, 5]), 4)
    with pytest.raises(ValueError, match="two draft tokens"):
        draft_target_ids(torch.tensor([1, 0]), 4)
    with pytest.raises(ValueError):
        tempered(torch.zeros(3), -0.5)


def test_params_take_temperatures_zero_or_above():
    assert ValueParams().eval.temperatures == [0.0]
    assert ValueParams(eval={"temperatures": [0, 1.0]}).eval.temperatures == [0.0, 1.0]
    for bad in ([-0.1], [], [1.0, 1.0]):
        with pytest.raises(ValueError):
            ValueParams(eval={"temperatures": bad})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """speculators' Eagle3DraftModel on a tiny random Llama (vocab 40, draft vocab 16) and one evaluation sequence."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_target")
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    target.save_pretrained(d)
    vcfg = LlamaConfig.from_pretrained(d)
    vcfg.num_hidden_layers = 1
    kept = torch.tensor([0, 2, 3, 5, 7, 8, 11, 13, 17, 19, 23, 29, 31, 37, 38, 39])
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[kept] = True
    draft = Eagle3DraftModel.from_training_args(
        vcfg, t2d=t2d, d2t=kept - torch.arange(16), draft_vocab_size=16, norm_before_residual=True,
        norm_before_fc=True, norm_output=True, ttt_steps=3, verifier_name_or_path=str(d), target_layer_ids=[0, 1, 2],
        draft_attn_impl="sdpa").float().eval()
    n = 30
    seq = EvalSeq("synthetic", "0", 6, torch.randint(0, 40, (n,)).tolist(), aux=torch.randn(n, 3, 32),
                  pre_norm=torch.randn(n, 32))
    head = target_head_of(target)
    seq.target_next = head(seq.pre_norm).argmax(-1)
    return draft, seq, head


def test_on_a_real_draft_t0_is_offline_taus_figure_and_vllms_greedy_drafts_take_ps_mass(tiny):
    draft, seq, head = tiny
    K = 3
    t0, cold, hot, hot_greedy = (*sampled_taus(draft, seq, K, draft.d2t, head, [0.0, 1e-4, 1.0]),
                                 *sampled_taus(draft, seq, K, draft.d2t, head, [1.0], draft_temperature=0))
    correct = chain_correct(draft, seq, K, draft.d2t)
    assert t0.anchors == correct.shape[0] == len(seq.input_ids) - seq.prompt_len - K
    assert torch.equal(t0.alpha, correct.double())
    assert t0.accepted == accepted_per_anchor(correct)
    assert torch.allclose(cold.alpha, t0.alpha, atol=1e-6)
    assert ((hot.alpha > 0) & (hot.alpha < 1)).all()
    # vLLM's point-mass draft: step k keeps the draft's own argmax token with the target's probability at T
    n, first = len(seq.input_ids), seq.prompt_len - 1
    ids = torch.as_tensor(seq.input_ids)
    with torch.no_grad():
        toks = draft(hidden_states=seq.aux.flatten(1)[:-1][None], input_ids=ids[1:][None],
                     document_ids=torch.zeros(1, n - 1, dtype=torch.long),
                     position_ids=torch.arange(1, n)[None], ttt_steps=K)
    p = torch.softmax(head(seq.pre_norm).double(), -1)
    t = torch.arange(first, first + t0.anchors)
    for k in range(K):
        d = toks[k][0, t]
        assert torch.allclose(hot_greedy.alpha[:, k], p[t + 1 + k, d + draft.d2t[d]], atol=1e-6)
    pos = sampled_positions([hot, t0], K)
    both = torch.cat([hot.alpha, t0.alpha]).cumprod(-1).mean(0)
    assert pos == [round(float(v), 4) for v in both] and pos[0] >= pos[1] >= pos[2]
    assert sampled_positions([], K) == [None] * K
