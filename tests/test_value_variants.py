"""06's ablation: each variant's data is made by the project's own stages (02, 04, 05) in a run folder of its own,
and is what its name says; the paired τ difference and the storage rule by their definitions.

The base is the ci run (SmolLM2 embedded, 4 samples) through 04 in speculators' layout (HF forward) and 05; its
records carry a dataset reply each (`meta.reference_reply`, unicode included), as a dataset that ends with an
assistant turn gives them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orjson
import pytest
import torch
from safetensors.torch import load_file

from eagle3data.core.params import load_params
from eagle3data.core.models import tokenizer_for
from eagle3data.export.run import run_export
from eagle3data.hidden.extract import run_extract
from eagle3data.prompts.load import load_datasets
from eagle3data.value.compare import storage_decision
from eagle3data.value.spread import paired_diff
from eagle3data.value.train import TrainConfig, _loader
from eagle3data.value.variants import build_variant, variant_data

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base(ci_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("ablation")
    shutil.copytree(ci_run.run_dir / "records", root / "ci" / "records")
    # the ci datasets as prompt files carrying the dataset's own reply (meta.reference_reply, as a published row that
    # ends with an assistant turn gives it, and as builtin:v1_stdlib_tasks holds it)
    datasets = []
    for name, ps in load_datasets(ci_run).items():
        path = root / f"{name}.jsonl"
        rows = [p.as_row() | {"meta": {"reference_reply": f"Use `sorted(xs)` for {name}/{p.sample_id} — a new list, "
                                                          "the input unchanged ✓."}} for p in ps.prompts]
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        datasets.append({"name": name, "path": str(path), "format": "prompts"})
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(root), "hidden.probe_batches": 0,
                                                  "hidden.layout": "speculators", "hidden.storage": "bf16",
                                                  "export.draft_vocab_size": 64, "export.formats": ["speculators"]})
    p = p.model_copy(update={"datasets": [type(p.datasets[0]).model_validate(d) for d in datasets]})
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RANK", raising=False)
        mp.delenv("WORLD_SIZE", raising=False)
        res = run_extract(p, progress=False)
        assert res.merged and res.verification.ok
        run_export(p)
    return p


def _handoff(path: Path) -> tuple[dict, dict[str, int]]:
    m = json.loads((path / "handoff.json").read_text(encoding="utf-8"))
    return m, {k: i for i, k in enumerate(m["keys"])}


def _states(handoff: Path, row: int) -> torch.Tensor:
    return load_file(str(handoff / "hidden_states" / f"hs_{row}.safetensors"))["hidden_states"].float()


def test_each_variant_is_built_by_the_stages_and_is_what_its_name_says(base, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    exact_dir = base.run_dir / "export" / "speculators"
    em, erow = _handoff(exact_dir)
    keys = list(em["keys"])
    said: list[str] = []
    tok = tokenizer_for(base)
    from datasets import load_from_disk

    exact_ids = {k: list(map(int, load_from_disk(str(exact_dir))[i]["input_ids"])) for k, i in erow.items()}

    # retokenized: 02 rebuilt the ids from the text (same text back); states by 04 for those ids
    r = build_variant(base, "retokenized", keys, said.append)
    rm, rrow = _handoff(r.handoff)
    assert sorted(rm["keys"]) == sorted(keys) and sum(r.info["proof_levels"].values()) == r.info["api_records"] == len(keys)
    rds = load_from_disk(str(r.handoff))
    for k, i in rrow.items():
        ids = list(map(int, rds[i]["input_ids"]))
        assert tok.decode(ids) == tok.decode(exact_ids[k])  # what the API gave, spelled the same
    assert (base.run_dir / "value" / "retokenized" / "run" / "reconstruct" / "summary.json").exists()

    # dataset_replies: the dataset's reply, not the target's output, is what is trained on
    d = build_variant(base, "dataset_replies", keys, said.append)
    dm, drow = _handoff(d.handoff)
    dds = load_from_disk(str(d.handoff))
    for k, i in drow.items():
        text = tok.decode([int(t) for t, m in zip(dds[i]["input_ids"], dds[i]["loss_mask"]) if m])
        assert f"Use `sorted(xs)` for {k} — a new list, the input unchanged ✓." in text

    # shifted: 04's writer got each sample's states one row early; verify-hidden's own command fails the store
    s = build_variant(base, "shifted", keys, said.append)
    v = s.info["verify_hidden"]
    assert v["exit"] == 1 and not v["ok"] and v["failed_samples"] >= 1, v
    sm, srow = _handoff(s.handoff)
    for k in keys:
        a, b = _states(exact_dir, erow[k]), _states(s.handoff, srow[k])
        assert torch.equal(b[:-1], a[1:]) and not torch.equal(a, b)

    # int8: stored in 8 bits by 04 (shards), converted by 05 for speculators: close to exact, not equal
    i8 = build_variant(base, "int8", keys, said.append)
    im, irow = _handoff(i8.handoff)
    assert im["converted_files"] == len(keys) and im["linked_files"] == 0
    for k in keys:
        a, b = _states(exact_dir, erow[k]), _states(i8.handoff, irow[k])
        rel = (a - b).norm() / a.norm()
        assert 0 < rel < 0.05, (k, float(rel))

    # fp8: speculators' FP8 files, linked, and 06's loader reads them through FP8Transfer
    f8 = build_variant(base, "fp8", keys, said.append)
    fm, _ = _handoff(f8.handoff)
    assert fm["hidden_states_backend"] == "fp8" and fm["linked_files"] == len(keys)
    loader, _ = _loader(f8.handoff, f8.rows, 576, TrainConfig(total_seq_len=512))
    batch = next(iter(loader))
    assert batch["hidden_states"].dtype == torch.float32 and torch.isfinite(batch["hidden_states"]).all()

    # a built variant is kept; exact and half take the run's hand-off
    said.clear()
    again = build_variant(base, "int8", keys, said.append)
    assert any("built earlier, kept" in x for x in said) and again.rows == i8.rows
    half = variant_data(base, "half", exact_dir, list(range(4)), keys, said.append)
    assert half.handoff == exact_dir and half.rows == [0, 1]


def test_dataset_replies_without_replies_is_refused_in_one_line(ci_run, tmp_path):
    from eagle3data.value.train import ValueStageError

    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path)})
    keys = [f"{json.loads(x)['dataset']}/{json.loads(x)['sample_id']}"
            for f in (tmp_path / "ci" / "records").glob("*.jsonl") for x in f.read_text().splitlines() if x]
    with pytest.raises(ValueStageError, match=r"builtin:b1_glaive: no prompt of dataset b1_glaive has meta.reference_reply"):
        build_variant(p, "dataset_replies", keys, lambda s: None)


def test_paired_difference_is_zero_for_the_same_draft_and_excludes_zero_for_a_worse_one():
    base = [(a, 10) for a in (3, 5, 4, 6, 2, 5, 4, 3, 6, 5, 4, 4)]
    est, ci = paired_diff(base, base)
    assert est == 0 and ci == [0, 0]
    worse = [(a - 1, 10) for a, _ in base]
    est, ci = paired_diff(base, worse)
    assert est == pytest.approx(-0.1) and ci[1] < 0
    noisy = [(a + (1 if i % 2 else -1), 10) for i, (a, _) in enumerate(base)]
    est, ci = paired_diff(base, noisy)
    assert ci[0] < 0 < ci[1]


def _summary(int8_ci, fp8_ci):
    ex = {"per_dataset": {"humaneval": {"prompts": 100, "tau_engine": 1.5}, "held": {"prompts": 100, "tau_engine": 1.5}}}
    return {"variants": [{"variant": "exact", **ex},
                         {"variant": "int8", "diff_to_exact": {"tau_engine": 0.0, "tau_engine_ci95": int8_ci}},
                         {"variant": "fp8", "diff_to_exact": {"tau_engine": -0.01, "tau_engine_ci95": fp8_ci}}]}


def test_the_storage_rule_switches_a_layout_only_when_its_loss_is_proven_small():
    d = storage_decision(_summary([-0.012, 0.01], [-0.05, 0.02]))
    assert d["limit"] == -0.015 and d["int8"]["free"] and not d["fp8"]["free"]
    assert d["default"] == {"shards": "int8", "speculators": "bf16", "specforge": "bf16"}
    d = storage_decision(_summary([-0.02, 0.01], [-0.01, 0.0]))
    assert d["default"] == {"shards": "bf16", "speculators": "fp8_e4m3", "specforge": "bf16"}
    d = storage_decision({"variants": [_summary([0, 0], [0, 0])["variants"][0]]})
    # a table without the 8-bit variants decides nothing about them, and says so
    assert d["default"] == {"shards": None, "speculators": None, "specforge": "bf16"} and d["int8"] == {"measured": False}
    assert d["params_follow"] is None
    one = _summary([-0.012, 0.01], [0, 0])
    d = storage_decision({"variants": one["variants"][:2]})  # int8 measured, fp8 not
    assert d["default"] == {"shards": "int8", "speculators": None, "specforge": "bf16"}
    assert d["params_follow"] is True  # the params store int8 in shards; speculators' fp8 is not judged here
    from eagle3data.core.params.hidden import storage_default_text
    assert storage_default_text(d["default"]) == "shards int8, speculators not measured, specforge bf16"


def test_the_table_shows_each_variant_against_exact_in_every_view(tmp_path):
    from eagle3data.audit.report import value_html
    from eagle3data.value.plots import diff_figure, diff_table, position_figure, summary_markdown
    from eagle3data.value.plots import save_figures
    from eagle3data.value.run import summary_lines

    f = {"prompts": 10, "tau_engine": 1.4, "tau_engine_ci95": [1.3, 1.5], "tau_offline": 1.45,
         "tau_offline_ci95": [1.35, 1.55], "per_position": [0.3, 0.08, 0.02], "per_position_engine": [0.3, 0.07, 0.02],
         "lossless": True}
    d = {"prompts": 10, "tau_engine": -0.31, "tau_engine_ci95": [-0.35, -0.27], "tau_offline": -0.3,
         "tau_offline_ci95": [-0.33, -0.26], "eval_tokens": 1280, "significant": True, "eval_tokens_to_resolve": None}
    s = {"eval": {"num_speculative_tokens": 3},
         "variants": [{"variant": "exact", "about": "x", "train_tokens": 100, "per_dataset": {"humaneval": f}},
                      {"variant": "shifted", "about": "one early", "train_tokens": 100, "per_dataset": {"humaneval": f},
                       "diff_to_exact": d, "verify_hidden": {"ok": False, "failed_samples": 7, "samples": 9, "exit": 1}},
                      {"variant": "int8", "about": "8 bits", "train_tokens": 100, "per_dataset": {"humaneval": f},
                       "diff_to_exact": d | {"tau_engine": 0.004, "tau_engine_ci95": [-0.01, 0.02],
                                             "significant": False, "eval_tokens_to_resolve": 40000}}]}
    s["storage_decision"] = storage_decision(s | {"variants": [dict(v, per_dataset=v["per_dataset"]) for v in s["variants"]]})
    md = summary_markdown(s)
    assert "| shifted | **-0.310** (-0.350–-0.270)" in md and "exit 1: 7 of 9 failed" in md and "| 40,000 |" in md
    text = summary_lines(s)
    assert "vs exact: Δτ engine -0.31" in text and "~40,000 would resolve it" in text and "storage default" in text
    t = diff_table(s)
    assert list(t["variant"]) == ["shifted", "int8"] and list(t["verify-hidden exit"])[0] == 1
    assert diff_figure(s) is not None and diff_figure({"variants": s["variants"][:1]}) is None
    assert position_figure(s) is not None
    (tmp_path / "value").mkdir()
    (tmp_path / "value" / "summary.json").write_text(json.dumps(s))
    page = value_html(tmp_path)
    assert "Each variant against exact" in page and "verify-hidden exit 1" in page and "Storage default" in page
    save_figures(tmp_path, s)  # what the stage writes beside summary.json: the markdown table and the curves
    assert (tmp_path / "value" / "summary.md").read_text() == md + "\n"
    assert (tmp_path / "value" / "tau_diff.png").stat().st_size > 0


def test_the_decision_names_the_noise_floor_when_retokenized_equals_exact():
    s = _summary([-0.02, 0.01], [-0.05, 0.02])
    rt = {"variant": "retokenized", "data": {"ids_differ_from_exact": {"rows": 9, "differ": 0}},
          "diff_to_exact": {"tau_engine": -0.011, "tau_engine_ci95": [-0.016, -0.004]}}
    d = storage_decision({"variants": s["variants"] + [rt]})
    assert d["noise_floor"]["diff"] == -0.011 and d["noise_floor"]["ci95"] == [-0.016, -0.004]
    rt["data"]["ids_differ_from_exact"]["differ"] = 3  # other ids: not a control of noise
    assert "noise_floor" not in storage_decision({"variants": s["variants"] + [rt]})


def test_a_variants_rows_follow_exacts_key_order_not_its_own_storage_order(tmp_path):
    from eagle3data.value.variants import _rows_of

    (tmp_path / "handoff.json").write_text(json.dumps({"keys": ["d/c", "d/a", "d/x", "d/b"]}))
    assert _rows_of(tmp_path, ["d/a", "d/b", "d/c"]) == [1, 3, 0]  # d/x: not a training key
    assert _rows_of(tmp_path, ["d/b", "d/gone", "d/a"]) == [3, 1]


def _pp(path: Path, accepted: list[int], steps: int = 10) -> None:
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"dataset": "humaneval" if i % 2 else "held", "sample_id": str(i), "offline_accepted": a, "anchors": steps,
             "engine_accepted": None, "engine_steps": None} for i, a in enumerate(accepted)]
    (path / "per_prompt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_exacts_seeds_pool_per_prompt_and_widen_the_judgement_of_a_difference(tmp_path):
    from eagle3data.value.compare import _per_prompt, diff_to_exact
    from eagle3data.value.spread import seed_spreads, size_curve

    rng = torch.Generator().manual_seed(0)
    base = torch.randint(2, 8, (40,), generator=rng).tolist()
    _pp(tmp_path / "exact", base)
    _pp(tmp_path / "exact_seed1", [a + 1 for a in base])
    _pp(tmp_path / "worse", [a - 1 for a in base])
    one = diff_to_exact(tmp_path, "worse")  # today's rule: exact's one draft, the evaluation interval alone
    assert (one["tau_offline"], one["tau_offline_ci95"]) == paired_diff([(a, 10) for a in base],
                                                                        [(a - 1, 10) for a in base])
    assert one["judged"]["judged_against"] == ["evaluation"] and one["significant"] and one["exact_seeds"] == 1
    assert one["judged"]["ci95"] == one["tau_offline_ci95"]
    # exact over two seeds: each prompt's counts summed over them (τ 1 + mean accepted/anchors of both)
    two = diff_to_exact(tmp_path, "worse", exact_folders=["exact", "exact_seed1"])
    assert two["tau_offline"] == pytest.approx(-0.15, abs=1e-4) and two["exact_seeds"] == 2
    runs = [{"variant": "exact", "draft_dir": "x", "per_dataset": {"humaneval": {"tau_offline": 1.4, "tau_engine": None}}},
            {"variant": "exact", "folder": "exact_seed1", "draft_dir": "y",
             "per_dataset": {"humaneval": {"tau_offline": 1.5, "tau_engine": None}}}]
    rows = [_per_prompt(tmp_path, "exact"), _per_prompt(tmp_path, "exact_seed1")]
    sp = seed_spreads(runs, rows, [0, 1])
    assert sp["seeds"] == [0, 1] and sp["per_dataset"]["humaneval"]["offline"]["sd"] == pytest.approx(0.0707, abs=1e-4)
    mean = sum(base) / len(base) / 10
    assert sp["pooled"]["offline"]["mean"] == pytest.approx(1 + mean + 0.05, abs=1e-4)
    assert sp["pooled"]["offline"]["sd"] == pytest.approx(0.0707, abs=1e-4) and sp["pooled"]["engine"]["seeds"] == 0
    judged = diff_to_exact(tmp_path, "worse", exact_folders=["exact", "exact_seed1"], spread=sp["pooled"])["judged"]
    assert judged["judged_against"] == ["evaluation", "training seeds"] and judged["seed_df"] == 1
    assert judged["ci95"][0] < two["tau_offline_ci95"][0] and judged["ci95"][1] > two["tau_offline_ci95"][1]
    assert seed_spreads(runs[:1], rows[:1], [0]) is None
    # the size curve: half (2,000 tokens, its own counts) and exact (4,000, pooled over its seeds): Δτ per doubling
    half = _per_prompt(tmp_path, "worse")
    curve = size_curve([("half", 2000, [half]), ("exact", 4000, rows)], 0, sp["pooled"])
    assert curve["variants"] == ["half", "exact"] and curve["tau"] == "offline"
    assert curve["slope_per_doubling"] == pytest.approx(0.15, abs=1e-4)  # exact's pooled τ − half's, one doubling
    assert curve["judged_against"] == ["evaluation", "training seeds"] and curve["ci95"][0] < 0.15 < curve["ci95"][1]


def test_seeds_and_temperatures_leave_a_finished_variants_fingerprint_and_seeds_hold_the_seed(tmp_path):
    from types import SimpleNamespace

    from eagle3data.value.run import _fingerprint, exact_seeds, with_seed

    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path)})
    plan, vd = SimpleNamespace(layer_ids=[2, 15, 27], evals=[1, 2]), SimpleNamespace(rows=[], info={})
    q = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "value.train.seeds": [0, 3, 1],
                                                  "value.eval.temperatures": [0.0, 1.0]})
    assert _fingerprint(p, plan, "exact", vd) == _fingerprint(q, plan, "exact", vd)
    assert exact_seeds(p) == [0] and exact_seeds(q) == [0, 3, 1]
    s3 = with_seed(q, 3)  # another seed's draft: its own fingerprint
    assert s3.value.train.seed == 3 and _fingerprint(s3, plan, "exact", vd) != _fingerprint(q, plan, "exact", vd)
    with pytest.raises(Exception, match="leave out seed 0"):
        load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "value.train.seeds": [1, 2]})


def test_the_table_shows_tau_per_temperature_and_exacts_seed_spread_only_when_measured():
    from eagle3data.value.plots import seed_table, summary_markdown, temperature_table
    from eagle3data.value.run import summary_lines
    from eagle3data.value.spread import judge_diff, seed_spread

    by_t = {"0.0": {"tau": 1.45, "tau_ci95": [1.35, 1.55], "per_position": [0.3, 0.1, 0.05]},
            "1.0": {"tau": 1.31, "tau_ci95": [1.25, 1.38], "per_position": [0.25, 0.05, 0.01]}}
    f = {"prompts": 10, "tau_engine": None, "tau_engine_ci95": None, "tau_offline": 1.45,
         "tau_offline_ci95": [1.35, 1.55], "per_position": [0.3, 0.1, 0.05], "per_position_engine": None,
         "lossless": None, "offline_by_temperature": {"0.0": by_t["0.0"]}}
    d = {"prompts": 10, "tau_engine": None, "tau_engine_ci95": None, "tau_offline": -0.05,
         "tau_offline_ci95": [-0.08, -0.02], "eval_tokens": 1280, "significant": True, "eval_tokens_to_resolve": None,
         "exact_seeds": 1, "judged": judge_diff(-0.05, [-0.08, -0.02])}
    s = {"eval": {"num_speculative_tokens": 3, "temperatures": [0.0]},
         "variants": [{"variant": "exact", "train_tokens": 100, "per_dataset": {"humaneval": f}},
                      {"variant": "half", "train_tokens": 50, "per_dataset": {"humaneval": f}, "diff_to_exact": d}]}
    plain_md, plain_text = summary_markdown(s), summary_lines(s)  # T = 0 and one seed: today's table
    assert "T=1" not in plain_md + plain_text and "seeds" not in plain_md + plain_text
    assert list(temperature_table(s)["T"]) == [0.0, 0.0] and seed_table(s).empty
    f2 = f | {"offline_by_temperature": by_t}
    sp = {"seeds": [0, 1, 2], "per_dataset": {"humaneval": {"offline": seed_spread([1.44, 1.46, 1.45]),
                                                            "engine": seed_spread([None])}},
          "pooled": {"offline": seed_spread([1.44, 1.46, 1.45]), "engine": seed_spread([None])}}
    j = judge_diff(-0.05, [-0.08, -0.02], 0.01, 2, 3, 1)
    s2 = {"eval": {"num_speculative_tokens": 3, "temperatures": [0.0, 1.0]}, "seed_spread": sp,
          "variants": [{"variant": "exact", "train_tokens": 100, "per_dataset": {"humaneval": f2}},
                       {"variant": "half", "train_tokens": 50, "per_dataset": {"humaneval": f2},
                        "diff_to_exact": d | {"exact_seeds": 3, "judged": j}}]}
    md, text = summary_markdown(s2), summary_lines(s2)
    # T = 1: the engine's column empty where it did not serve the variant, offline's figure beside it
    assert md.startswith(plain_md.split("\n\nτ per doubling")[0]) and "| exact | humaneval | – | 1.310 (1.25–1.38) |" in md
    assert "exact over seeds [0, 1, 2]" in md and "| humaneval | offline | 1.450 | 0.01 | 1.440–1.460 |" in md
    assert f"| half | -0.050 | ({j['ci95'][0]:.3f}–{j['ci95'][1]:.3f}) |" in md
    assert "offline τ at T=1 1.31 [1.25, 1.38]" in text and "judged against evaluation and 3 seeds" in text
    assert list(temperature_table(s2)["T"]) == [0.0, 1.0, 0.0, 1.0] and list(seed_table(s2)["sd"]) == [0.01, 0.01]


def test_the_stage_trains_exact_per_seed_and_gathers_spread_judgement_and_slope(tmp_path, monkeypatch):
    """run_value's wiring, its heavy steps stood in for: exact once per seed in its own folder (the other variants
    once), the target's head handed to every variant, the seed spread, each Δτ judged against it, the size slope."""
    from types import SimpleNamespace

    import eagle3data.value.run as R
    from eagle3data.value.evalset import EvalPrompt

    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path), "value.variants": ["exact", "half"],
                                                  "value.train.seeds": [0, 1, 2], "value.eval.engine": False})
    evals = [EvalPrompt("humaneval" if i % 2 else "held", str(i), [1, 2, 3], "x") for i in range(30)]
    plan = R.ValuePlan(p.run_dir, p.run_dir / "export" / "speculators", tmp_path, [2, 15, 27], evals, [0, 1], ["a", "b"],
                       0, ["exact", "half"])
    head = object()
    calls = []
    gen = torch.Generator().manual_seed(1)
    hard = torch.randint(0, 4, (30,), generator=gen).tolist()  # a prompt's difficulty, shared by every draft

    def fake_variant(params, plan, variant, seqs, say, head_, folder=None, seqs_at=None):
        assert head_ is head and len(seqs) == 30 and seqs_at == {}
        seed, folder = params.value.train.seed, folder or variant
        calls.append((variant, folder, seed))
        bonus = {"exact": 2 + seed % 2, "half": 1}[variant]  # the seeds move exact's τ; half is a doubling below
        rows = [{"dataset": e.dataset, "sample_id": e.sample_id, "offline_accepted": h + bonus, "anchors": 10,
                 "engine_accepted": None, "engine_steps": None} for e, h in zip(evals, hard)]
        (plan.run_dir / "value" / folder).mkdir(parents=True, exist_ok=True)
        (plan.run_dir / "value" / folder / "per_prompt.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        per_ds = {}
        for ds in ("held", "humaneval"):
            rs = [x for x in rows if x["dataset"] == ds]
            per_ds[ds] = {"prompts": len(rs), "tau_engine": None, "tau_engine_ci95": None, "per_position": [0.1] * 3,
                          "tau_offline": 1 + sum(x["offline_accepted"] for x in rs) / (10 * len(rs)),
                          "tau_offline_ci95": [1.0, 2.0], "lossless": None, "per_position_engine": None}
        return {"variant": variant, "folder": folder, "seed": seed, "draft_dir": str(tmp_path / folder / "draft"),
                "train_tokens": {"exact": 4000, "half": 2000}[variant], "per_dataset": per_ds}

    for name, fn in {"load_extract_model": lambda params: object(), "load_config": lambda params: None,
                     "reference_continuations": lambda params, plan, say, model: {0.0: [[5] * 8 for _ in plan.evals]},
                     "layer_plan": lambda params, cfg: SimpleNamespace(hf_indices=[2, 15, 27]),
                     "target_states": lambda model, layers, seqs: None, "target_head_of": lambda model: head,
                     "run_variant": fake_variant, "git_state": lambda: {}, "package_versions": lambda: {},
                     "write_provenance": lambda *a: None, "save_figures": lambda *a: None}.items():
        monkeypatch.setattr(R, name, fn)
    s = R.run_value(p, plan=plan, say=lambda line: None)
    assert calls == [("exact", "exact", 0), ("half", "half", 0), ("exact", "exact_seed1", 1), ("exact", "exact_seed2", 2)]
    sp = s["seed_spread"]
    assert sp["seeds"] == [0, 1, 2] and [r["seed"] for r in sp["runs"]] == [0, 1, 2]
    mean_hard = sum(hard) / 300
    assert sp["pooled"]["offline"]["mean"] == pytest.approx(1 + mean_hard + (2 + 3 + 2) / 30, abs=1e-4)
    assert sp["pooled"]["offline"]["sd"] == pytest.approx(0.0577, abs=1e-4)
    d = next(v for v in s["variants"] if v["variant"] == "half")["diff_to_exact"]
    assert d["exact_seeds"] == 3 and d["tau_offline"] == pytest.approx(-(1 + 1 / 3) / 10, abs=1e-4)
    assert d["judged"]["judged_against"] == ["evaluation", "training seeds"] and d["judged"]["seed_df"] == 2
    sl = s["size_slope"]
    assert sl["variants"] == ["half", "exact"] and sl["slope_per_doubling"] == pytest.approx(0.1333, abs=1e-4)
    assert json.loads((p.run_dir / "value" / "summary.json").read_text())["seed_spread"]["seeds"] == [0, 1, 2]
    assert "exact over seeds [0, 1, 2]" in R.summary_lines(s)
    # the defaults (no seeds): exact once, no spread, each Δτ judged against the evaluation interval alone, as before
    calls.clear()
    p1 = p.model_copy(update={"value": p.value.model_copy(update={"train": p.value.train.model_copy(
        update={"seeds": None})})})
    s1 = R.run_value(p1, plan=plan, say=lambda line: None)
    assert calls == [("exact", "exact", 0), ("half", "half", 0)] and "seed_spread" not in s1
    d1 = next(v for v in s1["variants"] if v["variant"] == "half")["diff_to_exact"]
    assert d1["exact_seeds"] == 1 and d1["tau_offline"] == pytest.approx(-0.1, abs=1e-4)
    assert d1["judged"]["judged_against"] == ["evaluation"] and d1["judged"]["ci95"] == d1["tau_offline_ci95"]
    assert s1["size_slope"]["judged_against"] == ["evaluation"]


def test_a_difference_at_each_temperature_is_judged_against_exacts_seed_spread_at_that_temperature(tmp_path):
    """exact's seeds spread apart at T = 1 (τ 1.4 and 1.6) and agree at T = 0: sampled's Δτ at T = 1, clear of zero
    against the evaluation interval alone, is judged with the T = 1 spread (wide, not significant), its Δτ at T = 0
    with the T = 0 spread (σ 0: the evaluation interval)."""
    from eagle3data.value.compare import _per_prompt, diff_to_exact
    from eagle3data.value.spread import seed_spreads

    def rows(a1: float) -> list[dict]:
        return [{"dataset": "humaneval", "sample_id": str(i), "anchors": 10, "offline_accepted": 4 + i % 3,
                 "engine_steps": None, "engine_accepted": None, "engine_by_temperature": {},
                 "offline_accepted_by_temperature": {"0.0": 4 + i % 3, "1.0": a1 + i % 3}} for i in range(40)]

    for name, a1 in {"exact": 3, "exact_seed1": 5, "sampled": 5}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "per_prompt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(a1)))
    folders = ["exact", "exact_seed1"]
    runs = [{"variant": "exact", "draft_dir": f, "per_dataset": {"humaneval": {"tau_offline": 1.5, "tau_engine": None}}}
            for f in folders]
    sp = seed_spreads(runs, [_per_prompt(tmp_path, f) for f in folders], [0, 1], ["0.0", "1.0"])
    at = sp["pooled_by_temperature"]
    assert at["0.0"]["offline"]["sd"] == 0 and at["1.0"]["offline"]["sd"] == pytest.approx(0.1414, abs=1e-4)
    assert at["1.0"]["offline"]["mean"] == pytest.approx(1.4975, abs=1e-4) and at["1.0"]["engine"]["seeds"] == 0
    d = diff_to_exact(tmp_path, "sampled", 0, folders, sp["pooled"], [0.0, 1.0], at)
    t0, t1 = d["by_temperature"]["0.0"], d["by_temperature"]["1.0"]
    assert t1["tau_offline"] == pytest.approx(0.1, abs=1e-4) and t1["tau_offline_ci95"][0] > 0  # clear of 0 alone
    assert t1["judged"]["judged_against"] == ["evaluation", "training seeds"] and t1["judged"]["seed_df"] == 1
    assert t1["judged"]["ci95"][0] < 0 < t1["judged"]["ci95"][1] and t1["significant"] is False
    assert t0["tau_offline"] == 0 and t0["significant"] is False and t0["judged"]["se_seed"] == 0
    # without a spread at that temperature: the evaluation interval alone, as at T = 0 without seeds
    alone = diff_to_exact(tmp_path, "sampled", 0, folders, None, [1.0])["by_temperature"]["1.0"]
    assert alone["judged"]["judged_against"] == ["evaluation"] and alone["significant"] is True


def test_engine_tau_per_temperature_and_each_difference_per_temperature_reach_every_view(tmp_path):
    """Engine τ at T = 1 (its per-request counts per temperature) and each Δτ per temperature, to exact and to the
    variant a variant was made from (sampled_retokenized against sampled), paired over the prompts."""
    from eagle3data.value.compare import diff_to
    from eagle3data.value.plots import diff_temperature_table, summary_markdown, temperature_table

    def rows(acc0: int, acc1: int) -> list[dict]:
        return [{"dataset": "humaneval", "sample_id": str(i), "anchors": 10, "offline_accepted": acc0 + i % 3,
                 "engine_steps": 8, "engine_accepted": acc0 + i % 2,
                 "offline_accepted_by_temperature": {"0.0": acc0 + i % 3, "1.0": acc1 + i % 3 / 2},
                 "engine_by_temperature": {"0.0": {"steps": 8, "accepted": acc0 + i % 2},
                                           "1.0": {"steps": 9, "accepted": acc1 + i % 2}}} for i in range(30)]

    for name, (a0, a1) in {"exact": (6, 4), "sampled": (6, 5), "sampled_retokenized": (6, 5)}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "per_prompt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(a0, a1)))
    d = diff_to(tmp_path, "sampled", ["exact"], temperatures=[0.0, 1.0])
    t1 = d["by_temperature"]["1.0"]
    assert d["by_temperature"]["0.0"]["tau_engine"] == 0 and t1["tau_engine"] == pytest.approx(1 / 9, abs=1e-3)
    assert t1["tau_engine_ci95"][0] > 0 and t1["tau_offline"] == pytest.approx(0.1, abs=1e-3)
    same = diff_to(tmp_path, "sampled_retokenized", ["sampled"], temperatures=[0.0, 1.0])
    assert same["reference"] == "sampled" and same["by_temperature"]["1.0"]["tau_engine"] == 0
    # exact's other seeds measured offline only: the engine Δτ takes the seeds that have it
    (tmp_path / "exact_seed1").mkdir()
    off = [r | {"engine_steps": None, "engine_accepted": None, "engine_by_temperature": {}} for r in rows(6, 4)]
    (tmp_path / "exact_seed1" / "per_prompt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in off))
    two = diff_to(tmp_path, "sampled", ["exact", "exact_seed1"], temperatures=[1.0])
    assert two["engine_reference_seeds"] == 1 and two["offline_reference_seeds"] == 2
    assert two["by_temperature"]["1.0"]["tau_engine"] == t1["tau_engine"]

    f = {"prompts": 30, "tau_engine": 1.75, "tau_engine_ci95": [1.7, 1.8], "tau_offline": 1.7,
         "tau_offline_ci95": [1.6, 1.8], "per_position": [0.5, 0.2, 0.1], "per_position_engine": None, "lossless": True,
         "offline_by_temperature": {"0.0": {"tau": 1.7, "tau_ci95": [1.6, 1.8], "per_position": [0.5, 0.2, 0.1]},
                                    "1.0": {"tau": 1.5, "tau_ci95": [1.4, 1.6], "per_position": [0.4, 0.1, 0.0]}},
         "engine_by_temperature": {"0.0": {"tau": 1.75, "tau_ci95": [1.7, 1.8]},
                                   "1.0": {"tau": 1.52, "tau_ci95": [1.45, 1.6]}}}
    s = {"eval": {"temperatures": [0.0, 1.0]},
         "variants": [{"variant": "exact", "train_tokens": 100, "per_dataset": {"humaneval": f}},
                      {"variant": "sampled", "train_tokens": 90, "per_dataset": {"humaneval": f},
                       "diff_to_exact": d},
                      {"variant": "sampled_retokenized", "train_tokens": 90, "per_dataset": {"humaneval": f},
                       "diff_to_exact": d, "diff_to": same}]}
    tt = temperature_table(s)
    assert list(tt.loc[tt["T"] == 1.0, "τ engine"]) == [1.52] * 3
    dt = diff_temperature_table(s)
    assert list(zip(dt["variant"], dt["against"], dt["T"])) == [
        ("sampled", "exact", 0.0), ("sampled", "exact", 1.0), ("sampled_retokenized", "exact", 0.0),
        ("sampled_retokenized", "exact", 1.0), ("sampled_retokenized", "sampled", 0.0),
        ("sampled_retokenized", "sampled", 1.0)]
    md = summary_markdown(s)
    assert "| exact | humaneval | 1.520 (1.45–1.60) | 1.500 (1.40–1.60) |" in md
    assert f"| sampled | exact | 1 | **" not in md and f"| sampled | exact | 1 | {t1['tau_engine']:+.3f}" in md


def test_a_finished_variant_is_kept_when_only_the_list_of_engine_variants_changed():
    """Adding the engine to one variant (`eval.engine_variants`) re-runs that variant only (its
    `engine_temperatures` change), not every variant whose fingerprint holds the list; any other change re-runs."""
    from eagle3data.value.run import made_alike

    fp = {"variant": "exact", "train": {"seed": 0}, "eval": {"humaneval": 164, "engine": True,
                                                             "engine_variants": ["exact"]}, "rows": 368}
    assert made_alike(fp, fp | {"eval": fp["eval"] | {"engine_variants": ["exact", "sampled"]}})
    assert made_alike(fp, fp | {"eval": {k: v for k, v in fp["eval"].items() if k != "engine_variants"}})
    assert not made_alike(fp, fp | {"eval": fp["eval"] | {"humaneval": 100}})
    assert not made_alike(fp, fp | {"rows": 367}) and not made_alike(fp, fp | {"train": {"seed": 1}})
