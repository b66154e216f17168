"""06's peer variants (issue 60): `template_other`'s rows are SpecForge 0.2.0's own (`preprocess_conversations` and
its whole `data.train_data_path` path, template `qwen`), and both peer variants' run folders hold what 02 would write,
so 04's mix takes them and 05 hands them off.

Rows of real shapes are made from the format fixtures (a reply cut at the token budget, a tool call in the history
with the tool's definitions and result, a multi-turn conversation, a conversation with and without its own system
prompt) as records with exact ids; the run folders are built on the ci run (SmolLM2 embedded, 4 samples: 2 with a
system prompt and tools, 2 without, every reply cut at 24 tokens) through 04 and 05.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from runfiles import ci_records_through_04, make_record  # noqa: E402

# installed by `make install`; a missing peer is a failure, not a skip
from specforge.data.preprocessing import preprocess_conversations
from specforge.data.prompt_builder import prepare_prompt_tasks
from specforge.data.template import TEMPLATE_REGISTRY

from eagle3data.core.profiles import get_profile
from eagle3data.core.reader import read_rebuilt, read_run, resolve
from eagle3data.export.run import conversation, run_export
from eagle3data.prompts.load import load_prompts, template_prompt
from eagle3data.rebuild.text import first_diff
from eagle3data.value.peer_rows import KINDS
from eagle3data.value.peer_variants import PEER_VARIANTS, peer_rows
from eagle3data.value.template_other import template_other_rows
from eagle3data.value.text_rule import text_rule_rows
from eagle3data.value.variants import VARIANTS, build_variant, variant_params

FORMATS = Path(__file__).parent / "fixtures" / "formats"
SMOL = get_profile("smollm2")
EOT = SMOL.end_of_turn.id
# the system prompts: SmolLM2's template inserts its own into a conversation without one; SpecForge's `qwen` its own
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_SYSTEM = "You are a helpful assistant."


def _prompt(fmt: str, file: str, n: int):
    return load_prompts(FORMATS / file, "fx", format=fmt).prompts[n]


def _sample(tok, prompt, *, cut: int | None = None):
    """A local record of the prompt with its dataset reply as the target's output (cut after `cut` tokens, finish
    `length`, or whole with its end-of-turn): its sample, record kept."""
    reply = prompt.meta["reference_reply"]
    out = tok.encode(reply, add_special_tokens=False)
    out, content = (out + [EOT], reply) if cut is None else (out[:cut], tok.decode(out[:cut]))
    rec = make_record("fx", prompt.sample_id, template_prompt(tok, prompt, SMOL), out, profile="smollm2",
                      messages=prompt.messages, tools=prompt.tools, content=content, reasoning=None, tool_calls=None,
                      finish_reason="stop" if cut is None else "length", sampling={"temperature": 0.0})
    return resolve(rec, {}, keep_record=True)


@pytest.fixture(scope="module")
def shapes(smollm2_tokenizer):
    tok = smollm2_tokenizer
    return {
        "multi_turn": _sample(tok, _prompt("sharegpt", "sharegpt.json", 0)),  # user, assistant, user; no system
        "cut_no_system": _sample(tok, _prompt("mixture_of_thoughts", "mixture_of_thoughts.jsonl", 0), cut=9),
        "cut_own_system": _sample(tok, _prompt("sharegpt", "sharegpt.json", 1), cut=4),  # "You answer in French."
        "tool_call": _sample(tok, _prompt("glaive", "glaive_function_calling_v2.json", 0)),  # tools, call, result
    }


@pytest.fixture(scope="module")
def rows(smollm2_tokenizer, shapes):
    got = template_other_rows(smollm2_tokenizer, SMOL, list(shapes.values()))
    return dict(zip(shapes, got))


def _system_span(ids: list[int], head: int) -> int:
    """The end of the system message's content: the first end-of-turn after the header."""
    return ids.index(EOT, head)


@pytest.mark.parametrize("shape", ["multi_turn", "cut_no_system"])
def test_template_other_differs_from_exact_by_the_system_prompt_only(smollm2_tokenizer, shapes, rows, shape):
    tok, s, r = smollm2_tokenizer, shapes[shape], rows[shape]
    ours, theirs = list(s.input_ids), r.input_ids
    head = tok.encode("<|im_start|>system\n", add_special_tokens=False)
    assert ours[:len(head)] == theirs[:len(head)] == head
    a, b = _system_span(ours, len(head)), _system_span(theirs, len(head))
    assert tok.decode(ours[len(head):a]) == SMOL_SYSTEM  # the target's template's own, which vLLM serves
    assert tok.decode(theirs[len(head):b]) == QWEN_SYSTEM == TEMPLATE_REGISTRY.get("qwen").system_prompt
    # every other id is exact's, in place: the system content is the one span that differs ...
    rest = ours[a:]
    assert theirs[b:b + len(rest)] == rest
    # ... and after exact's last id only the template's close of the turn: the newline after the model's end-of-turn,
    # or, for a reply cut at the budget, an end-of-turn the model never emitted there and that newline
    tail = theirs[b + len(rest):]
    assert tail == (tok.encode("\n", add_special_tokens=False) if s.finish_reason == "stop"
                    else [EOT, *tok.encode("\n", add_special_tokens=False)])
    d = first_diff(ours, theirs)
    assert len(head) <= d < min(a, b) and ours[len(head):d] == theirs[len(head):d]  # "You are a helpful" shared
    assert r.kind == "inside"


def _specforge(tok, s, template: str = "qwen"):
    conv = conversation(s.record)
    out = preprocess_conversations(tok, [conv["conversations"]], TEMPLATE_REGISTRY.get(template), 2048,
                                   tools=[conv.get("tools") or []])
    return out["input_ids"][0][0].tolist(), out["loss_mask"][0][0].tolist()


def test_template_other_is_specforges_own_row_and_supervises_every_assistant_turn(smollm2_tokenizer, shapes, rows):
    tok = smollm2_tokenizer
    for shape, s in shapes.items():
        r = rows[shape]
        # SpecForge's function called directly on 05's conversation of the record: the same ids, the same mask
        assert (r.input_ids, r.loss_mask) == _specforge(tok, s), shape
        # the mask is on each assistant turn's content and its `<|im_end|>\n`, nothing else (no header, no user)
        turns = [m for m in conversation(s.record)["conversations"] if m["role"] == "assistant"]
        supervised = tok.decode([i for i, m in zip(r.input_ids, r.loss_mask) if m])
        assert supervised == "".join(t["content"] + "<|im_end|>\n" for t in turns), shape
        # the reply's own tokens are exact's output ids, all supervised, and the row ends with them (and the close)
        out = s.input_ids[s.loss_mask.index(1):]
        at = len(r.input_ids) - len(out) - (1 if s.finish_reason == "stop" else 2)
        assert r.input_ids[at:at + len(out)] == out and all(r.loss_mask[at:]), shape
        assert not any(r.loss_mask[at - len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False)):at])


def test_specforges_whole_train_data_path_makes_the_same_rows_from_05s_conversations_file(smollm2_tokenizer, shapes,
                                                                                         rows, tmp_path):
    """`data.train_data_path` as `specforge train` reads it: datasets' JSON loader (its schema fills the keys a message
    lacks with None), `build_eagle3_dataset` (which shuffles), EAGLE-3's minimum of one loss token."""
    path = tmp_path / "conversations.jsonl"
    path.write_bytes(b"".join(orjson.dumps(conversation(s.record)) + b"\n" for s in shapes.values()))
    tasks = prepare_prompt_tasks(path, smollm2_tokenizer, chat_template="qwen", max_length=2048,
                                 is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None,
                                 num_proc=1, min_loss_tokens=1)
    theirs = sorted((t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks)
    assert theirs == sorted((r.input_ids, r.loss_mask) for r in rows.values())


def test_a_cut_reply_a_tool_call_and_a_multi_turn_conversation_each_make_a_row(smollm2_tokenizer, shapes, rows):
    tok = smollm2_tokenizer
    assert [str(r.key) for r in rows.values()] == [str(s.key) for s in shapes.values()]
    assert all(r.kind in KINDS and len(r.input_ids) == len(r.loss_mask) and any(r.loss_mask) for r in rows.values())
    # a cut reply in a conversation with its own system prompt: SpecForge keeps that prompt, so the ids are exact's
    # and then the end-of-turn the template closes the cut turn with (supervised) and its newline
    s, r = shapes["cut_own_system"], rows["cut_own_system"]
    assert r.input_ids == [*s.input_ids, EOT, *tok.encode("\n", add_special_tokens=False)]
    assert r.kind == "end_of_turn_added" and r.loss_mask[-2:] == [1, 1]
    # a tool call: SmolLM2's template renders content only, so SpecForge's text has neither the tools' definitions
    # nor the call (ours put both in, as the template asks: prompts.load.messages_for_template); the result stays
    s, r = shapes["tool_call"], rows["tool_call"]
    ours, theirs = tok.decode(s.input_ids), tok.decode(r.input_ids)
    assert "get_weather" in ours and "get_weather" not in theirs and '"sky": "clear"' in theirs
    assert r.kind == "inside"
    # a multi-turn conversation: both of its assistant turns are supervised (exact supervises the reply only)
    s, r = shapes["multi_turn"], rows["multi_turn"]
    spans = sum(1 for a, b in zip([0, *r.loss_mask], r.loss_mask) if b and not a)
    assert spans == 2 and sum(s.loss_mask) < sum(r.loss_mask)


def test_the_peer_variants_are_listed_and_04_takes_their_unproven_rows_only_with_min_proof_level_text(ci_run):
    assert set(PEER_VARIANTS) <= set(VARIANTS)
    for v in PEER_VARIANTS:
        vp = variant_params(ci_run, v)
        assert vp.hidden.min_proof_level == "text" and vp.export.formats == ["speculators"]
        assert vp.run_dir == ci_run.run_dir / "value" / v / "run"
    assert ci_run.hidden.min_proof_level == "count"  # the default, which drops a `text` line as proof_too_low


@pytest.fixture(scope="module")
def base(ci_run, tmp_path_factory):
    p = ci_records_through_04(ci_run, tmp_path_factory.mktemp("peers"))
    run_export(p, formats=["speculators"])
    return p


def _lines(folder: Path) -> list[dict]:
    return [orjson.loads(x) for f in sorted(folder.glob("*.jsonl")) for x in f.read_bytes().splitlines() if x.strip()]


@pytest.mark.parametrize("variant", PEER_VARIANTS)
def test_the_variants_run_folder_holds_api_records_and_02_lines_that_04_and_05_take_as_the_peers_rows(
        base, variant, smollm2_tokenizer, monkeypatch):
    from datasets import load_from_disk

    from eagle3data.hidden.mix import build_mix, read_mix

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    exact = base.run_dir / "export" / "speculators"
    keys = [str(k) for k in json.loads((exact / "handoff.json").read_text(encoding="utf-8"))["keys"]]
    train = keys[::-1]  # another order than the hand-off's: the variant's rows must follow it
    samples = read_run(base.run_dir, verdicts=False).samples(keep_record=True)
    by_key = {str(k): s for k, s in samples.items()}
    want = {str(r.key): r for r in peer_rows(variant, smollm2_tokenizer, SMOL, [by_key[k] for k in train],
                                             max_length=base.model.max_context)}
    if variant == "text_rule":  # the other helper's function, called as the variant calls it
        assert [r.input_ids for r in want.values()] == [
            r.input_ids for r in text_rule_rows(smollm2_tokenizer, SMOL, [by_key[k] for k in train])]
    said: list[str] = []
    vd = build_variant(base, variant, train, said.append)
    vrun = base.run_dir / "value" / variant / "run"
    # records as an API run writes them: no ids, the text the peer read; one per training row
    recs = _lines(vrun / "records")
    assert sorted(f"{r['dataset']}/{r['sample_id']}" for r in recs) == sorted(train)
    assert all(r.get("prompt_ids") is None and r.get("output_ids") is None and "ids_exact" not in r
               and r["source"] == "api" and r["provider"] == variant for r in recs)
    assert all(r["content"] == by_key[f"{r['dataset']}/{r['sample_id']}"].record["content"] for r in recs)
    # 02's place: lines `core.reader.resolve` turns into exactly the peer's rows, unproven, saying who made them
    lines = read_rebuilt(vrun)
    for rec in recs:
        s = resolve(rec, lines)
        r = want[str(s.key)]
        assert (s.input_ids, s.loss_mask, s.ids_exact) == (r.input_ids, r.loss_mask, False)
        line = lines[s.key]
        assert line["proof_level"] == "text" and line["kind"] == r.kind and "peer's text path" in line["made_by"]
    # 04's mix took every row (min_proof_level text) and stored those ids; the run's default level takes none
    mix = read_mix(vrun / "hidden")
    assert sorted(str(k) for k in mix.keys) == sorted(train)
    assert all((m.input_ids, m.loss_mask) == (want[str(m.key)].input_ids, want[str(m.key)].loss_mask)
               for m in mix.samples)
    strict = build_mix(variant_params(base, variant).model_copy(
        update={"hidden": variant_params(base, variant).hidden.model_copy(update={"min_proof_level": "count"})}),
        write=False)
    assert not strict.entries and {d["reason"] for d in strict.dropped} == {"proof_too_low"}
    # 05's hand-off holds them; the variant trains on them in the order asked (exact's)
    hkeys = [str(k) for k in json.loads((vd.handoff / "handoff.json").read_text(encoding="utf-8"))["keys"]]
    ds = load_from_disk(str(vd.handoff))
    assert [hkeys[i] for i in vd.rows] == train
    for i, k in enumerate(hkeys):
        assert (list(map(int, ds[i]["input_ids"])), list(map(int, ds[i]["loss_mask"]))) == (
            want[k].input_ids, want[k].loss_mask)
    # built.json: the rows by kind and how many differ from exact's ids
    kinds = {k: sum(r.kind == k for r in want.values()) for k in KINDS}
    differ = sum(r.input_ids != list(by_key[k].input_ids) for k, r in want.items())
    assert vd.info["peer"]["kinds"] == kinds and vd.info["peer"]["ids_differ"] == differ
    assert vd.info["ids_differ_from_exact"] == {"rows": len(train), "differ": differ, "kinds": kinds}
    assert json.loads((vrun / "built.json").read_text(encoding="utf-8"))["peer"]["kinds"] == kinds
    assert differ == len(train)  # every ci reply is cut (and two rows lose their tools): no row is exact's
