"""API conversations regenerated turn by turn reach training: 01 (openai backend, `turns: all`) → 02 → 03 → 04 → 05.

A hosted API returns text, so 02 rebuilds each turn's ids; every later stage must find them under the
same key, `SampleKey.of(record)` = `dataset/sample_id#turn`. A key built by hand without the turn made
03 fail every API turn on `record.has_ids` and the mix drop them all. Real Qwen3 vocabulary; a loopback
OpenRouter-style server; a small random Qwen3-architecture target (the Qwen3 vocabulary) for 04.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import torch

from eagle3data.audit.run import run_audit
from eagle3data.export.run import run_export
from eagle3data.generate.run import run_generate
from eagle3data.hidden.extract import run_extract
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.mix import read_mix
from eagle3data.core.profiles import QWEN3
from eagle3data.prompts.load import Prompt, template_prompt
from eagle3data.core.reader import SampleKey, read_rebuilt, read_verdicts
from eagle3data.rebuild.run import run_reconstruct
from eagle3data.core.records import scan_journal
from loopback import LoopbackServer
from test_turns import CONVERSATIONS, KEY_ENV, _params, _prompts_file


@pytest.fixture(scope="module")
def qwen_target(tmp_path_factory, qwen):
    """A small random model of the Qwen3 architecture over the real Qwen3 vocabulary (04 needs ids < vocab)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(qwen), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("qwen_target")
    Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _records(params) -> list[dict]:
    return [r for p in sorted((params.run_dir / "records").glob("*.jsonl")) for r in scan_journal(p).records]


def test_api_turns_pass_03_and_reach_the_mix_index_and_both_exports(qwen, qwen_target, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    convs = {"c": CONVERSATIONS["c"], "w": CONVERSATIONS["w"],
             "c2": [{"role": "user", "content": "Name an animal."}, {"role": "assistant", "content": "cat"},
                    {"role": "user", "content": "Une autre, s'il te plaît — 日本語で"},
                    {"role": "assistant", "content": "dog"}]}
    with LoopbackServer("openai") as srv:
        # the provider bills the prompt it rendered: the same template over the messages sent
        srv.chat_script = lambda req: {"prompt_tokens": len(template_prompt(
            qwen, Prompt("d0", "x", req["messages"], req.get("tools")), QWEN3))}
        params = _params(tmp_path, model_path=str(qwen_target), **{
            "generate.backend": "openai", "generate.timeout_s": 10, "generate.concurrency": 4,
            "generate.openai": {"base_url": srv.base_url, "model": "m", "api_key_env": KEY_ENV},
            "datasets": [{"name": "d0", "path": str(_prompts_file(tmp_path, convs, "api"))}],
            # the loopback bills completions at 4 characters a token, so 02 proves these turns at `text`
            # (proof levels have their own tests); the mix's minimum is set to match
            "hidden.probe_batches": 0, "hidden.min_proof_level": "text",
            # a random-weight target predicts none of the loopback's text, so verify-hidden's head checks
            # fail its store (rightly): this test is about keys and turns, so 05 is told to export it anyway
            "export.allow_unverified": True,
            "export.formats": ["specforge", "speculators"]})
        assert run_generate(params, progress=False, tokenizer=qwen).status == "finished"
    recs = _records(params)
    done = [r for r in recs if r["finish_reason"] in ("stop", "length")]
    assert len(done) >= 5 and all(r.get("turn") is not None and r["output_ids"] is None for r in done)
    want = {SampleKey.of(r) for r in done}
    assert len(want) == len(done) and all("#" in k for k in want)

    run_reconstruct(params, progress=False, tokenizer=qwen)
    assert set(read_rebuilt(params.run_dir)) == want  # 02 rebuilt every turn, under its own key

    audit = run_audit(params, progress=False, tokenizer=qwen)
    verdicts = read_verdicts(params.run_dir)
    assert set(verdicts) == want
    failed = {k: v["failed"] for k, v in verdicts.items() if v["failed"]}
    assert failed == {}, failed  # record.has_ids found the rebuilt ids of every turn
    assert (audit.meta["ids_from"] == "reconstruct").sum() == len(done)

    ext = run_extract(params, progress=False)
    mix = read_mix(ext.hidden_dir)
    assert {s.key for s in mix.samples} == want, [(d["key"], d["reason"]) for d in mix.dropped]
    # the mix file, the index and the exports each carry the row the key is made from, turn included
    mix_rows = pq.read_table(ext.hidden_dir / "mix.parquet").to_pandas()
    assert [str(SampleKey.of(r)) for _, r in mix_rows.iterrows()] == mix_rows["key"].tolist() == \
        [str(s.key) for s in mix.samples]
    reader = HiddenReader(ext.hidden_dir)
    assert reader.keys() == [str(s.key) for s in mix.samples]
    assert [str(SampleKey.of(r)) for _, r in reader.index.iterrows()] == reader.keys()
    first = reader.sample(reader.keys()[0])
    assert first["hidden_states"].shape[0] == len(mix.samples[0].input_ids)

    exp = run_export(params)
    assert set(exp.manifests) == {"specforge", "speculators"}
    for fmt, m in exp.manifests.items():
        assert m["exported"] == len(want), fmt
    for path in sorted((params.run_dir / "export").rglob("*.jsonl")):
        ids = [orjson.loads(ln).get("id") for ln in path.read_bytes().splitlines() if ln.strip()]
        if ids and ids[0] is not None:
            assert set(ids) == {str(k) for k in want}, path
    for path in sorted((params.run_dir / "export").rglob("*.parquet")):
        t = pq.read_table(path).to_pandas()
        if "id" in t and "sample_id" in t:
            assert [str(SampleKey.of(r)) for _, r in t.iterrows()] == t["id"].tolist(), path
            assert set(t["id"]) == {str(k) for k in want}, path
