"""Stage 06: the offline acceptance length by its definition (an oracle draft scores K+1, an always-wrong one 1,
a brute-force chain over truncated inputs agrees with the batched TTT computation), the draft's layers from the
store's own plan (a draft on other layers refused before serving), the leak guard, and a draft from a few
training steps served by the real vLLM CPU server with speculative ids equal to plain greedy ids.

The tiny hand-off is the ci run (SmolLM2 embedded, 4 samples) through 04 in speculators' layout and 05.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3data.core.params import VLLMServerParams, load_params
from eagle3data.export import handoff as HO
from eagle3data.hidden.capture import layer_plan, load_config, load_extract_model
from eagle3data.hidden.mix import hidden_dir, read_mix
from runfiles import ci_records_through_04
from eagle3data.value.evalset import EvalPrompt, held_out_prompts, humaneval_problems, leak_problems
from eagle3data.value.offline import (EvalSeq, OfflineTau, accepted_per_anchor, chain_correct, offline_tau, per_position,
                                     target_states)
from eagle3data.value.run import plan_value
from eagle3data.value.spread import ratio_ci
from eagle3data.value.train import (TrainConfig, TrainingStopped, ValueStageError, build_draft, check_draft_layers,
                                    layer_ids_of_store, load_draft, train_draft)

REPO = Path(__file__).resolve().parents[1]
K = 3


@pytest.fixture(scope="module")
def handoff(ci_run, tmp_path_factory):
    """The ci run's records through 04 (speculators' layout) and 05's speculators hand-off (draft vocab 64)."""
    p = ci_records_through_04(ci_run, tmp_path_factory.mktemp("value"), storage=None)  # the layout's default store
    HO.write_handoff(p, read_mix(hidden_dir(p)).samples, p.run_dir / "export" / "speculators", "speculators")
    return p


@pytest.fixture(scope="module")
def trained(handoff, tmp_path_factory):
    """A draft from a few training steps on the hand-off (speculators' model, our loop)."""
    p = handoff
    out = tmp_path_factory.mktemp("draft")
    ids = layer_ids_of_store(p.run_dir / "hidden")
    from eagle3data.generate.backends.vllm_server import model_dir  # the folder the engine serves

    res = train_draft(p.run_dir / "export" / "speculators", model_dir(p), ids, out,
                      TrainConfig(epochs=3, total_seq_len=512, checkpoint_every=2), list(range(4)), say=lambda s: None)
    return p, res


@pytest.fixture(scope="module")
def seqs(handoff):
    """The ci run's own sequences (prompt + greedy output) with the target's states, as 06 evaluates them."""
    from eagle3data.core.reader import read_run

    p = handoff
    model = load_extract_model(p)
    recs = [r for r in read_run(p.run_dir, rebuilt=False, verdicts=False).records() if r.get("output_ids")]
    out = [EvalSeq(r["dataset"], str(r["sample_id"]), len(r["prompt_ids"]), r["prompt_ids"] + r["output_ids"])
           for r in recs]
    target_states(model, layer_plan(p, load_config(p)), out)
    return out


class _Scripted:
    """A stand-in draft: step k's token at shifted position t, in draft ids, from a rule (identity vocabulary)."""

    def __init__(self, seq: EvalSeq, rule):
        self.seq, self.rule = seq, rule

    def __call__(self, *, hidden_states, input_ids, document_ids, position_ids, ttt_steps):
        n = input_ids.shape[1]
        return [torch.tensor([[self.rule(t, k) for t in range(n)]]) for k in range(ttt_steps)]


def _identity_d2t(vocab: int = 49152) -> torch.Tensor:
    return torch.zeros(vocab, dtype=torch.long)


def test_an_oracle_draft_scores_k_plus_one_and_an_always_wrong_one_scores_one(seqs):
    s = seqs[0]
    tn = s.target_next.tolist()
    # the oracle: at anchor t (input x[t+1], state g[t]) step k proposes the target's argmax at t+1+k
    oracle = _Scripted(s, lambda t, k: tn[t + 1 + k] if t + 1 + k < len(tn) else 0)
    wrong = _Scripted(s, lambda t, k: (tn[t + 1 + k] + 1) % 49152 if t + 1 + k < len(tn) else 0)
    o, w = offline_tau(oracle, s, K, _identity_d2t()), offline_tau(wrong, s, K, _identity_d2t())
    assert o.anchors == w.anchors == len(s.input_ids) - s.prompt_len - K > 0  # anchors P-1 .. n-2-K
    assert o.tau == K + 1 and w.tau == 1.0
    # an oracle one position late (the off-by-one a layer or shift bug makes) is not an oracle
    late = _Scripted(s, lambda t, k: tn[t + 2 + k] if t + 2 + k < len(tn) else 0)
    assert offline_tau(late, s, K, _identity_d2t()).tau < 1.5


def test_the_chain_stops_at_its_first_miss():
    c = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    assert accepted_per_anchor(c) == [3, 1, 0, 2]


def _brute_force(draft, s: EvalSeq, d2t) -> list[int]:
    """Per anchor, the draft's own chain on inputs cut at the anchor: step k sees the tokens it proposed itself."""
    ids = torch.as_tensor(s.input_ids)
    hs = s.aux.float().flatten(1)
    n, P = len(ids), s.prompt_len
    tn = s.target_next
    out = []
    for t in range(P - 1, n - 1 - K):
        own: list[int] = []
        acc = 0
        for k in range(K):
            inp = torch.cat([ids[1:t + 2], torch.tensor(own, dtype=torch.long)])
            hid = torch.cat([hs[:t + 1], torch.zeros(len(own), hs.shape[1])])
            m = len(inp)
            with torch.no_grad():
                toks = draft(hidden_states=hid[None], input_ids=inp[None], document_ids=torch.zeros(1, m, dtype=torch.long),
                             position_ids=torch.arange(1, m + 1)[None], ttt_steps=k + 1)
            d = int(toks[k][0, t])
            pred = d + int(d2t[d])
            own.append(pred)
            if pred != int(tn[t + 1 + k]):
                break
            acc += 1
        out.append(acc)
    return out


def test_offline_tau_equals_a_brute_force_loop_over_anchors(trained, seqs):
    _, res = trained
    draft = load_draft(res.draft_dir)
    s = min(seqs, key=lambda x: len(x.input_ids))
    batched = offline_tau(draft, s, K, draft.d2t).accepted
    assert batched == _brute_force(draft, s, draft.d2t)
    assert len(batched) > 5


def test_the_drafts_layers_are_the_stores_own_and_a_draft_on_other_layers_is_refused(trained, tmp_path):
    p, res = trained
    store = json.loads((p.run_dir / "hidden" / "index.json").read_text())["hf_indices"]
    cfg = json.loads((res.draft_dir / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == store == [2, 15, 27]
    bad = tmp_path / "draft"
    shutil.copytree(res.draft_dir, bad)
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 14, 26]  # decoder-layer numbering: trains fine, serves wrong layers
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueStageError, match=r"eagle_aux_hidden_state_layer_ids: \[1, 14, 26\]"):
        check_draft_layers(bad, store)


def test_training_stops_on_request_and_resumes_from_its_checkpoint_to_the_same_draft(handoff, trained, tmp_path):
    p, res = trained
    from eagle3data.generate.backends.vllm_server import model_dir  # the folder the engine serves

    ids = layer_ids_of_store(p.run_dir / "hidden")
    cfg = TrainConfig(epochs=3, total_seq_len=512, checkpoint_every=2)
    ho = p.run_dir / "export" / "speculators"
    asked = []  # a stop asked for after the first step (the run's STOP file): checkpoint written, TrainingStopped
    with pytest.raises(TrainingStopped) as stopped:
        train_draft(ho, model_dir(p), ids, tmp_path, cfg, list(range(4)), say=lambda s: None,
                    stop=lambda: asked.append(1) or True)
    assert stopped.value.step == 1 and len(asked) == 1 and (tmp_path / "checkpoint.pt").exists()
    first = train_draft(ho, model_dir(p), ids, tmp_path, TrainConfig(**{**cfg.__dict__, "max_steps": 2}),
                        list(range(4)), say=lambda s: None)
    assert first.steps == 2 and (tmp_path / "checkpoint.pt").exists()
    full = train_draft(ho, model_dir(p), ids, tmp_path, cfg, list(range(4)), say=lambda s: None)
    assert full.steps == res.steps and [r["loss"] for r in full.log] == pytest.approx([r["loss"] for r in res.log],
                                                                                      rel=1e-4)
    said = []  # the same rows in another order are other batches: the finished checkpoint is not theirs
    other = train_draft(ho, model_dir(p), ids, tmp_path, cfg, [3, 2, 1, 0], say=said.append)
    assert any("training from the start" in x for x in said) and not any("resuming" in x for x in said)
    assert [r["step"] for r in other.log] == list(range(1, other.steps + 1))


def test_held_out_prompts_that_leak_into_training_are_refused(handoff, monkeypatch):
    p = handoff
    from eagle3data.core.reader import read_run
    import eagle3data.value.evalset as EV

    recs = read_run(p.run_dir, rebuilt=False, verdicts=False).records()
    text = next(m["content"] for m in recs[0]["messages"] if m["role"] == "user")
    # a HumanEval problem whose text is a training record's prompt
    monkeypatch.setattr(EV, "humaneval_problems", lambda limit=None: [{"task_id": "HumanEval/0", "prompt": text}])
    pv = p.model_copy(update={"value": p.value.model_copy(update={"eval": p.value.eval.model_copy(
        update={"humaneval": 1, "held_out_per_dataset": 0})})})
    with pytest.raises(ValueStageError, match="holds the text of evaluation prompt humaneval/HumanEval/0"):
        plan_value(pv)
    # by key: a held-out conversation that is still a training row
    held = held_out_prompts(recs, 1, 0)
    keys = [f"{r['dataset']}/{r['sample_id']}" for r in recs]
    assert any("is a training row" in x for x in leak_problems(held, keys, {}, "handoff.json"))
    # the plan itself holds them out
    pv = p.model_copy(update={"value": p.value.model_copy(update={"eval": p.value.eval.model_copy(
        update={"humaneval": 0, "held_out_per_dataset": 1})})})
    plan = plan_value(pv)
    assert plan.excluded_rows == 2 and len(plan.train_rows) == 2
    assert not {e.key for e in plan.evals} & {k.split("#")[0] for k in plan.train_keys}


def test_humaneval_is_the_packages_164_problems():
    probs = humaneval_problems()
    assert len(probs) == 164 and probs[0]["task_id"] == "HumanEval/0" and "def " in probs[0]["prompt"]


def test_ratio_interval_covers_its_estimate_and_narrows_with_more_prompts():
    est, ci = ratio_ci([2, 1, 0, 3] * 5, [4, 4, 4, 4] * 5)
    assert est == pytest.approx(1.375) and ci[0] < est < ci[1]
    _, wide = ratio_ci([2, 1, 0, 3], [4, 4, 4, 4])
    assert wide[1] - wide[0] > ci[1] - ci[0]


def test_the_value_command_without_a_handoff_says_one_line(ci_run, tmp_path):
    run = tmp_path / "ci"
    shutil.copytree(ci_run.run_dir, run)
    r = subprocess.run([sys.executable, "-m", "eagle3data", "value", str(run)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "no speculators hand-off" in r.stderr


@pytest.mark.slow
def test_a_few_step_draft_serves_in_real_vllm_with_greedy_ids(trained, seqs):
    from eagle3data.value.engine import serve

    if not (REPO / ".engine" / "bin" / "python").exists():
        pytest.skip(".engine/ absent: run `make engine` (make test builds it)")
    p, res = trained
    prompts = [s.input_ids[: s.prompt_len] for s in seqs[:3]]
    srv = VLLMServerParams(port=0)
    plain, _ = serve(p, srv, prompts, 24, stage="t_plain", say=lambda s: None)
    spec, info = serve(p, srv, prompts, 24, stage="t_spec", draft_dir=res.draft_dir, k=K, say=lambda s: None)
    assert [x.ids for x in spec] == [x.ids for x in plain]
    assert all(x.steps for x in spec)
    assert info["counters"]["spec_decode_num_drafts"] == sum(x.steps for x in spec)
    assert info["counters"]["spec_decode_num_accepted_tokens"] == sum(x.accepted for x in spec)


def test_offline_tau_per_temperature_is_the_greedy_figure_at_zero_and_a_kept_variant_gains_a_temperature(
        trained, seqs, tmp_path):
    """06's offline τ per temperature (vLLM's greedy drafts): at T = 0 anchor for anchor `offline_tau`'s, with the
    same interval; at T = 1 its own figure; a disagreement with the greedy chain refused; a finished variant kept by
    its fingerprint is measured at a temperature it lacks, from its draft, nothing retrained."""
    from eagle3data.value.run import _add_temperatures
    from eagle3data.value.sampling import offline_by_temperature, target_head_of

    p, res = trained
    draft = load_draft(res.draft_dir)
    head = target_head_of(load_extract_model(p))
    greedy = [offline_tau(draft, s, K, draft.d2t) for s in seqs]
    pp, anchors, per_ds = offline_by_temperature(draft, seqs, head, K, [0.0, 1.0], seed=0, greedy=greedy)
    assert anchors == [{"0.0": o.anchors, "1.0": o.anchors} for o in greedy]  # both along the greedy continuations
    assert {x["along"] for f in per_ds.values() for x in f.values()} == {"greedy"}
    assert [r["0.0"] for r in pp] == [sum(o.accepted) for o in greedy]
    for ds in dict.fromkeys(s.dataset for s in seqs):
        idx = [i for i, s in enumerate(seqs) if s.dataset == ds]
        t0, t1 = per_ds[ds]["0.0"], per_ds[ds]["1.0"]
        assert (t0["tau"], t0["tau_ci95"]) == ratio_ci([sum(greedy[i].accepted) for i in idx],
                                                       [greedy[i].anchors for i in idx], 0)
        assert t0["per_position"] == per_position([greedy[i] for i in idx], K)
        assert 1.0 <= t1["tau"] <= K + 1 and t1["tau_ci95"][0] <= t1["tau"] <= t1["tau_ci95"][1]
    assert any(r["1.0"] != r["0.0"] for r in pp)  # sampling's acceptance is not the greedy indicator
    off = [OfflineTau(o.anchors, [min(a + 1, K) for a in o.accepted]) for o in greedy]
    with pytest.raises(ValueStageError, match="differs from the greedy chain"):  # a T > 0 pass checks T = 0 too
        offline_by_temperature(draft, seqs, head, K, [0.0, 1.0], greedy=off)
    assert offline_by_temperature(draft, seqs, None, K, [0.0])[2] == {ds: {"0.0": f["0.0"]} for ds, f in per_ds.items()}

    out = tmp_path / "value" / "exact"
    shutil.copytree(res.draft_dir, out / "draft")
    rows = [{"dataset": s.dataset, "sample_id": s.sample_id, "offline_accepted_by_temperature": r}
            for s, r in zip(seqs, offline_by_temperature(draft, seqs, head, K, [0.0])[0])]
    (out / "per_prompt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prev = {"variant": "exact", "per_dataset": {ds: {"offline_by_temperature": {"0.0": f["0.0"]}}
                                                for ds, f in per_ds.items()}}
    pt = p.model_copy(update={"value": p.value.model_copy(update={"eval": p.value.eval.model_copy(
        update={"temperatures": [0.0, 1.0]})})})
    said = []
    kept = _add_temperatures(json.loads(json.dumps(prev)), out, seqs, head, pt, said.append)
    assert {ds: f["offline_by_temperature"] for ds, f in kept["per_dataset"].items()} == per_ds
    assert json.loads((out / "result.json").read_text()) == kept and len(said) == 1
    assert [json.loads(x)["offline_accepted_by_temperature"] for x in (out / "per_prompt.jsonl").read_text().splitlines()] \
        == pp
    assert _add_temperatures(kept, out, seqs, head, pt, said.append) is kept and len(said) == 1  # nothing missing


def test_offline_tau_at_t_is_taken_along_the_targets_own_sampled_continuations(trained, seqs, handoff, tmp_path):
    """With continuations the target sampled at T (`at`), offline τ at T is speculative sampling's acceptance along
    them (their own anchors), T = 0 stays the greedy figure; a kept variant measured along the greedy continuations
    is measured again along the sampled ones."""
    from eagle3data.value.run import _add_temperatures
    from eagle3data.value.sampling import offline_by_temperature, sampled_taus, target_head_of

    p, res = trained
    model = load_extract_model(p)
    head = target_head_of(model)
    draft = load_draft(res.draft_dir)
    torch.manual_seed(0)
    other = []
    for s in seqs:  # the target's own continuation at T = 1 (HF sampling), with its states
        prompt = s.input_ids[: s.prompt_len]
        with torch.inference_mode():
            g = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=True, temperature=1.0, top_k=0,
                               top_p=1.0)
        other.append(EvalSeq(s.dataset, s.sample_id, s.prompt_len, g[0].tolist()))
    target_states(model, layer_plan(p, load_config(p)), other)
    assert any(o.input_ids != s.input_ids[: len(o.input_ids)] for o, s in zip(other, seqs))
    pp, anchors, per_ds = offline_by_temperature(draft, seqs, head, K, [0.0, 1.0], seed=0, at={1.0: other})
    want = [sampled_taus(draft, o, K, draft.d2t, head, [1.0], draft_temperature=0)[0] for o in other]
    assert [r["1.0"] for r in pp] == [round(sum(w.accepted), 4) for w in want]
    assert [a["1.0"] for a in anchors] == [w.anchors for w in want]
    assert [r["0.0"] for r in pp] == [sum(offline_tau(draft, s, K, draft.d2t).accepted) for s in seqs]
    for ds, f in per_ds.items():
        idx = [i for i, s in enumerate(seqs) if s.dataset == ds]
        assert (f["1.0"]["along"], f["0.0"]["along"]) == ("sampled at T", "greedy")
        assert (f["1.0"]["tau"], f["1.0"]["tau_ci95"]) == ratio_ci([sum(want[i].accepted) for i in idx],
                                                                   [want[i].anchors for i in idx], 0)
    with pytest.raises(ValueStageError, match="not of the evaluation prompts"):
        offline_by_temperature(draft, seqs, head, K, [0.0, 1.0], at={1.0: other[::-1]})

    out = tmp_path / "value" / "exact"  # a variant kept from a run that took T = 1 along the greedy continuations
    shutil.copytree(res.draft_dir, out / "draft")
    g_pp, _, g_ds = offline_by_temperature(draft, seqs, head, K, [0.0, 1.0], seed=0)
    rows = [{"dataset": s.dataset, "sample_id": s.sample_id, "offline_accepted_by_temperature": r}
            for s, r in zip(seqs, g_pp)]
    (out / "per_prompt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prev = {"variant": "exact", "per_dataset": {ds: {"offline_by_temperature": f} for ds, f in g_ds.items()}}
    pt = p.model_copy(update={"value": p.value.model_copy(update={"eval": p.value.eval.model_copy(
        update={"temperatures": [0.0, 1.0]})})})
    said = []
    assert _add_temperatures(prev, out, seqs, head, pt, said.append) is prev and not said  # greedy wanted: kept
    kept = _add_temperatures(json.loads(json.dumps(prev)), out, seqs, head, pt, said.append, {1.0: other})
    assert {ds: f["offline_by_temperature"] for ds, f in kept["per_dataset"].items()} == per_ds and len(said) == 1
    got = [json.loads(x) for x in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert [r["offline_accepted_by_temperature"] for r in got] == pp
    assert [r["offline_anchors_by_temperature"] for r in got] == anchors


@pytest.mark.slow
def test_a_training_step_leaves_no_peer_line_on_stderr_and_puts_them_in_the_log(handoff, tmp_path, capfd):
    """06's own training and draft loading (speculators' draft: its loguru lines, transformers' past_key_values
    FutureWarning raised in kernels) with a loguru handler on stderr as a notebook's kernel has."""
    import sys

    from loguru import logger

    from eagle3data.generate.backends.vllm_server import model_dir
    from eagle3data.core.peer_logs import PEER_LOG
    from eagle3data.value.train import DRAFT_DIR, TrainConfig, layer_ids_of_store, load_draft, train_draft

    p = handoff
    hid = logger.add(sys.stderr, format="{name}: {message}")
    try:
        res = train_draft(p.run_dir / "export" / "speculators", model_dir(p), layer_ids_of_store(p.run_dir / "hidden"),
                          tmp_path, TrainConfig(epochs=1, total_seq_len=512, max_steps=1), list(range(4)), say=print)
        load_draft(res.draft_dir)
    finally:
        logger.remove(hid)
    out, err = capfd.readouterr()
    assert res.draft_dir == tmp_path / DRAFT_DIR and "train 1/1" in out
    log = (tmp_path / PEER_LOG).read_text(encoding="utf-8")
    for peer in ("not found in weight_map", "Loading from local directory", "past_key_values"):
        assert peer not in err and peer in log, peer
    assert log.count("Tensor 'lm_head.weight' not found in weight_map") == 2  # training's draft, then load_draft's
