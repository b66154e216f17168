"""06's variants whose data the target generates again: `sampled` (01 at value.sampled_temperature, seeded), its
API-text copy `sampled_retokenized` (02 rebuilds the ids), and `double` (each dataset's limit doubled, greedy); and
`quarter`, exact's first quarter. Each is made by the stages (01 -> 03 -> 04 -> 05, or 02 -> 04 -> 05) in its own
folder, keeps the run's held-out conversations out of its rows, and is what its name says.

The base is the ci run (SmolLM2 embedded, 2 + 2 prompts, local backend) through 04 in speculators' layout and 05.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from eagle3data.core.models import tokenizer_for
from eagle3data.core.reader import SampleKey
from eagle3data.export.run import run_export
from eagle3data.value.run import _engine_temperatures, plan_value
from eagle3data.value.train import ValueStageError
from eagle3data.value.variants import build_variant, variant_data
from runfiles import ci_records_through_04

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base(ci_run, tmp_path_factory):
    p = ci_records_through_04(ci_run, tmp_path_factory.mktemp("regenerated"))
    run_export(p, formats=["speculators"])
    return p


def _keys(handoff: Path) -> list[str]:
    return [str(k) for k in json.loads((handoff / "handoff.json").read_text(encoding="utf-8"))["keys"]]


def _ids(handoff: Path) -> dict[str, list[int]]:
    from datasets import load_from_disk

    ds = load_from_disk(str(handoff))
    return {k: list(map(int, ds[i]["input_ids"])) for i, k in enumerate(_keys(handoff))}


def _records(folder: Path) -> list[dict]:
    return [orjson.loads(x) for f in sorted((folder / "records").glob("*.jsonl"))
            for x in f.read_bytes().splitlines() if x.strip()]


def test_sampled_and_its_api_copy_are_regenerated_by_the_stages_and_keep_held_out_conversations_out(base, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    exact = base.run_dir / "export" / "speculators"
    keys = _keys(exact)
    held = frozenset({keys[0].split("#", 1)[0]})  # one conversation held out, as 06's plan holds some out
    train = [k for k in keys if k.split("#", 1)[0] not in held]
    said: list[str] = []

    s = build_variant(base, "sampled", train, said.append, held=held)
    vdir = base.run_dir / "value" / "sampled"
    gen = _records(next(vdir.glob("gen_*")))
    # 01 ran at the sampled temperature, seeded, on every prompt of the run (its own folder), 03 audited them
    assert len(gen) == len(_records(base.run_dir)) and {r["sampling"]["temperature"] for r in gen} == {1.0}
    assert {r["sampling"]["seed"] for r in gen} == {base.generate.sampling.seed}
    assert s.info["generate"]["temperature"] == 1.0 and (vdir / "run" / "audit" / "summary.json").exists()
    assert s.info["audit"]["records"] == len(_records(vdir / "run"))
    # the held-out conversation is in no record 04 saw, and in no training row
    assert all(f"{r['dataset']}/{r['sample_id']}" not in held for r in _records(vdir / "run"))
    skeys = _keys(s.handoff)
    assert s.rows and all(skeys[i].split("#", 1)[0] not in held for i in s.rows)
    # sampled at T = 1: not the greedy ids (24 tokens of a 135M model: some row differs)
    exact_ids, sampled_ids = _ids(exact), _ids(s.handoff)
    assert any(sampled_ids[k] != exact_ids.get(k) for k in sampled_ids)
    # a record flagged by text.roundtrip (a non-canonical split the target sampled) is kept, not dropped by 03
    verdicts = [json.loads(x) for x in (vdir / "run" / "audit" / "verdicts.jsonl").read_text().splitlines() if x]
    flagged = {str(SampleKey.of(v)) for v in verdicts if "text.roundtrip" in v["flagged"]}
    assert not any("text.roundtrip" in v["failed"] for v in verdicts) and flagged <= set(skeys)

    # its API copy: the same records as text, ids rebuilt by 02; compared with sampled, row for row
    r = build_variant(base, "sampled_retokenized", train, said.append, held=held)
    assert (base.run_dir / "value" / "sampled_retokenized" / "run" / "reconstruct" / "summary.json").exists()
    d = r.info["ids_differ_from_sampled"]
    assert d["rows"] == len(_keys(r.handoff)) and 0 <= d["differ"] <= d["rows"]
    tok = tokenizer_for(base)
    rids = _ids(r.handoff)
    assert set(rids) <= set(sampled_ids)
    for k, ids in rids.items():  # the text is the target's: spelled the same whatever the split
        assert tok.decode(ids) == tok.decode(sampled_ids[k])
    rkeys = _keys(r.handoff)
    assert [rkeys[i] for i in r.rows] == [k for k in (skeys[i] for i in s.rows) if k in rids]

    # kept when built again with the same params; rebuilt when the temperature changes
    said.clear()
    again = build_variant(base, "sampled", train, said.append, held=held)
    assert any("built earlier, kept" in x for x in said) and again.rows == s.rows
    hot = base.model_copy(update={"value": base.value.model_copy(update={"sampled_temperature": 0.7})})
    said.clear()
    build_variant(hot, "sampled", train, said.append, held=held)
    assert not any("built earlier, kept" in x for x in said)
    assert {r["sampling"]["temperature"] for r in _records(vdir / "run")} == {0.7}
    assert len(list(vdir.glob("gen_*"))) == 2  # 01's folder per settings: the T = 1 records are kept beside


def test_double_generates_the_runs_prompts_and_as_many_new_ones_and_quarter_takes_exacts_first_rows(base, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    exact = base.run_dir / "export" / "speculators"
    keys = _keys(exact)
    held = frozenset({keys[-1].split("#", 1)[0]})
    train = [k for k in keys if k.split("#", 1)[0] not in held]
    said: list[str] = []
    d = build_variant(base, "double", train, said.append, held=held)
    gen = _records(next((base.run_dir / "value" / "double").glob("gen_*")))
    run_recs = _records(base.run_dir)
    run_ids = {(r["dataset"], str(r["sample_id"])) for r in run_recs}
    gen_ids = {(r["dataset"], str(r["sample_id"])) for r in gen}
    # the run's prompts, and as many new ones as the datasets hold (ci's b5_openthoughts has 3 of the 4 asked)
    assert run_ids < gen_ids and len(gen_ids) == 7 and len(gen) == 7
    # the run's own records are the first half, as 01 wrote them (never generated again): 01 made the new ones only
    assert all(r in gen for r in run_recs) and d.info["generate"]["reused_from_run"] == len(run_recs)
    assert d.info["generate"]["new_records"] == len(gen) - len(run_recs) == 3
    assert any(f"{len(run_recs)} of the run's own 01 records copied" in x for x in said)
    assert {r["sampling"]["temperature"] for r in gen} == {0.0}
    dkeys = _keys(d.handoff)
    rows = [dkeys[i] for i in d.rows]
    assert all(k.split("#", 1)[0] not in held for k in rows)
    assert rows[: len([k for k in train if k in dkeys])] == [k for k in train if k in dkeys]  # exact's order first
    assert len(rows) > len(train)

    q = variant_data(base, "quarter", exact, list(range(8)), keys, lambda s: None)
    assert q.handoff == exact and q.rows == [0, 1]


def test_the_runs_records_go_into_a_new_journal_only_and_only_those_01_would_write_with_its_settings(base, tmp_path):
    from eagle3data.value.variants import _generate_params, reuse_run_records, variant_params

    gp = _generate_params(variant_params(base, "double"))
    gp = gp.model_validate(gp.model_dump(mode="json") | {"output_root": str(tmp_path)})  # double's 01, elsewhere
    run_recs = _records(base.run_dir)
    assert reuse_run_records(base, gp) == len(run_recs) and _records(gp.run_dir) == run_recs
    assert reuse_run_records(base, gp) == 0 and _records(gp.run_dir) == run_recs  # a journal begun is never rewritten
    # other sampling (here a temperature), another model's name, or an error: none is copied
    data = gp.model_dump(mode="json")
    data["output_root"], data["generate"]["sampling"]["temperature"] = str(tmp_path / "hot"), 0.7
    assert reuse_run_records(base, gp.model_validate(data)) == 0
    data["output_root"], data["generate"]["sampling"]["temperature"] = str(tmp_path / "named"), 0.0
    data["model"]["name"] = "another/model"
    assert reuse_run_records(base, gp.model_validate(data)) == 0
    src = base.model_validate(base.model_dump(mode="json") | {"output_root": str(tmp_path / "src"), "run_name": "r"})
    (src.run_dir / "records").mkdir(parents=True)
    bad = [r | {"finish_reason": "error", "output_ids": None, "ids_exact": False} if i == 0 else r
           for i, r in enumerate(run_recs)]
    name = run_recs[0]["dataset"]
    (src.run_dir / "records" / f"{name}.jsonl").write_bytes(
        b"".join(orjson.dumps(r) + b"\n" for r in bad if r["dataset"] == name))
    data["output_root"], data["model"]["name"] = str(tmp_path / "errors"), base.model.name
    got = gp.model_validate(data)
    assert reuse_run_records(src, got) == sum(r["dataset"] == name for r in run_recs) - 1
    assert all(r["finish_reason"] != "error" for r in _records(got.run_dir))


def test_the_plan_refuses_what_cannot_be_compared_or_doubled_and_the_engine_serves_the_variants_asked(base):
    def params(**value):
        data = base.model_dump(mode="json")
        data["value"] |= {"enabled": True} | value
        return type(base).model_validate(data)

    with pytest.raises(ValueStageError, match="sampled_retokenized is compared with sampled; add sampled"):
        plan_value(params(variants=["exact", "sampled_retokenized"]))
    with pytest.raises(ValueStageError, match=r"engine_variants: 'half' is not in value.variants"):
        plan_value(params(variants=["exact"], eval={"engine_variants": ["half"]}))
    nolimit = params(variants=["exact", "double"])
    nolimit = nolimit.model_copy(update={"datasets": [d.model_copy(update={"limit": None}) for d in nolimit.datasets]})
    with pytest.raises(ValueStageError, match="has no limit: variant double doubles each dataset's limit"):
        plan_value(nolimit)
    p = params(variants=["exact", "half"], eval={"engine_variants": ["exact"], "temperatures": [1.0, 0.0]})
    assert _engine_temperatures(p, "exact") == [0.0, 1.0] and _engine_temperatures(p, "half") == []
    assert _engine_temperatures(params(eval={"engine": False}), "exact") == []


def test_eagle3data_value_takes_value_overrides_only_and_refuses_others_in_one_line(base):
    import subprocess
    import sys

    from eagle3data.core.params.run import with_overrides
    from eagle3data.core.provenance import params_of_run

    p = params_of_run(base.run_dir)
    q = with_overrides(p, {"value.eval.temperatures": "[0.0, 1.0]", "value.eval.engine_variants": "[exact]"},
                       str(base.run_dir), only="value")
    assert q.value.eval.temperatures == [0.0, 1.0] and q.value.eval.engine_variants == ["exact"]
    assert q.model_dump(exclude={"value"}) == p.model_dump(exclude={"value"})
    r = subprocess.run([sys.executable, "-m", "eagle3data", "value", str(base.run_dir), "-p", "hidden.storage", "int8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "param hidden.storage (-p): only value.* can be changed here" in r.stderr
    r = subprocess.run([sys.executable, "-m", "eagle3data", "value", str(base.run_dir), "-p", "value.sampled_temperature",
                        "9"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "value.sampled_temperature" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
