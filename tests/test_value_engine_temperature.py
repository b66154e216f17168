"""Stage 06's engine τ at T > 0 (value/engine.py `serve_temperatures`), on the real vLLM CPU server with a draft
from a few training steps (test_value.py's fixtures): one server start, one pass per temperature.

At T = 0 a pass equals `serve`'s greedy one (ids and per-request figures), also after a T = 1 pass on the same
server, and so does a pass at T = 0.001 (the tempered path of vLLM's rejection sampler, near one-hot: on vLLM's CPU
build it samples noise without engine.py's CPU fix, vllm-project/vllm#55005); at T = 1 the per-request seeds make a pass reproducible (same seed: same ids) and another seed samples
other ids; every pass's per-request steps and accepted drafts add up to the server's counters' increase over that
pass; τ at T = 1 lies in [1, K + 1]. Two of the prompts are longer than a step's token budget, so the first pass
of each server chunks seeded prefills (on vLLM's CPU build the engine dies there without engine.py's generator fix).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3data.core.params import VLLMServerParams
from eagle3data.value.engine import EngineEvalError, request_seed, serve, serve_temperatures
from eagle3data.value.sampling import temperature_key
from test_value import handoff, trained  # noqa: F401  (module fixtures: the ci hand-off and its few-step draft)

REPO = Path(__file__).resolve().parents[1]
K = 3
MAX_NEW = 24
COLD = 0.001


def test_request_seeds_are_reproducible_distinct_per_prompt_and_depend_on_seed_and_temperature():
    a = [request_seed(0, 1.0, i) for i in range(200)]
    assert a == [request_seed(0, 1, i) for i in range(200)] and len(set(a)) == 200
    assert all(0 <= s < 2**31 for s in a)
    assert a != [request_seed(1, 1.0, i) for i in range(200)]
    assert a != [request_seed(0, 0.7, i) for i in range(200)]


def test_temperatures_must_be_distinct_and_not_negative():
    for bad in ((), (1.0, 1.0), (-0.5,)):
        with pytest.raises(EngineEvalError):
            serve_temperatures(None, None, [[1]], 4, stage="t", temperatures=bad)


@pytest.fixture(scope="module")
def passes(trained):  # noqa: F811
    """Four server starts with the draft: serve() (greedy); T = 1, 0, 0.001 (seed 0); T = 1 (seed 0); T = 1 (seed 1)."""
    from eagle3data.core.reader import read_run

    if not (REPO / ".engine" / "bin" / "python").exists():
        pytest.skip(".engine/ absent: run `make engine` (make test builds it)")
    p, res = trained
    short = [r["prompt_ids"] for r in read_run(p.run_dir, rebuilt=False, verdicts=False).records()
             if r.get("output_ids")][:4]
    # two long prompts (1,100 tokens: the short ones repeated) beside two short ones, and a step budget of 512
    # tokens: each server's first pass chunks their seeded prefills (vLLM's CPU generator rewind, every time)
    prompts = short[:2] + [(s * (1100 // len(s) + 1))[:1100] for s in short[2:]]
    srv = VLLMServerParams(port=0, max_model_len=2048, extra_args=["--max-num-batched-tokens", "512"])
    kw = dict(draft_dir=res.draft_dir, k=K, say=lambda s: None)
    lines: list[str] = []
    greedy = serve(p, srv, prompts, MAX_NEW, stage="t_greedy", **kw)
    both = serve_temperatures(p, srv, prompts, MAX_NEW, stage="t_both", temperatures=(1.0, 0.0, COLD), seed=0,
                              **kw | {"say": lines.append})
    again = serve_temperatures(p, srv, prompts, MAX_NEW, stage="t_again", temperatures=(1.0,), seed=0, **kw)
    other = serve_temperatures(p, srv, prompts, MAX_NEW, stage="t_other", temperatures=(1.0,), seed=1, **kw)
    return prompts, greedy, both, again, other, lines


@pytest.mark.slow
def test_t0_after_a_t1_pass_on_the_same_server_is_serves_greedy_pass(passes):
    prompts, (g, _), (both, info), *_ = passes
    assert list(both) == [1.0, 0.0, COLD] and all(len(v) == len(prompts) for v in both.values())
    assert [(x.ids, x.steps, x.accepted, x.per_step) for x in both[0.0]] == [
        (x.ids, x.steps, x.accepted, x.per_step) for x in g]
    assert all(x.steps for x in g)


@pytest.mark.slow
def test_a_cold_temperature_samples_the_greedy_ids_through_the_rejection_sampler(passes, trained):  # noqa: F811
    _, (g, _), (both, _), *_ = passes
    assert [(x.ids, x.steps, x.accepted) for x in both[COLD]] == [(x.ids, x.steps, x.accepted) for x in g]
    lines = (trained[0].run_dir / "engine" / "vllm_cpu_fix" / "mark_t_both.txt").read_text().splitlines()
    assert lines and all(ln.split(" ", 1)[1] in ("expand: applied; rewind: applied",
                                                 "expand: not needed (Triton runs); rewind: applied") for ln in lines)


@pytest.mark.slow
def test_t1_is_seeded_reproducible_and_another_seed_samples_other_ids(passes):
    _, _, (both, _), (again, _), (other, _), _ = passes
    assert [x.ids for x in again[1.0]] == [x.ids for x in both[1.0]]
    assert [(x.steps, x.accepted, x.per_step) for x in again[1.0]] == [
        (x.steps, x.accepted, x.per_step) for x in both[1.0]]
    assert any(a.ids != b.ids for a, b in zip(other[1.0], both[1.0]))


@pytest.mark.slow
def test_each_passs_per_request_figures_add_up_to_its_counters_increase(passes):
    _, (g, ginfo), (both, info), (again, ainfo), (other, oinfo), lines = passes
    runs = [({0.0: g}, ginfo), (both, info), (again, ainfo), (other, oinfo)]
    for served, inf in runs:
        assert set(inf["by_temperature"]) == {temperature_key(T) for T in served}
        for T, xs in served.items():
            c = inf["by_temperature"][temperature_key(T)]["counters"]
            assert c["spec_decode_num_drafts"] == sum(x.steps for x in xs) > 0, (T, c)
            assert c["spec_decode_num_accepted_tokens"] == sum(x.accepted for x in xs), (T, c)
            assert c["spec_decode_num_draft_tokens"] == K * c["spec_decode_num_drafts"]
        first = inf["by_temperature"][temperature_key(next(iter(served)))]
        assert inf["counters"] == first["counters"] and inf["serve_s"] == first["serve_s"]
    assert ginfo["counters"]["spec_decode_num_drafts"] == info["by_temperature"]["0.0"]["counters"][
        "spec_decode_num_drafts"]
    assert any(s.startswith("t_both T=1: ") for s in lines) and any(s.startswith("t_both T=0: ") for s in lines)


@pytest.mark.slow
def test_tau_at_t1_lies_between_1_and_k_plus_1(passes):
    _, _, (both, _), *_ = passes
    xs = both[1.0]
    tau = 1 + sum(x.accepted for x in xs) / sum(x.steps for x in xs)
    assert 1.0 <= tau <= K + 1
    assert all(1.0 <= x.tau <= K + 1 for x in xs)
    assert all(len(x.per_step) == x.steps and sum(x.per_step) == x.accepted for x in xs)
