"""Dataset formats: each published row shape turns into the right messages, tools and tool turns;
a malformed row is rejected with its location and reason; ids survive a reshuffle of the rows."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3data.prompts.formats import FORMATS
from eagle3data.core.profiles import SMOLLM2
from eagle3data.prompts.load import check_source, load_prompts, messages_for_template

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "formats"

# (fixture, format, a malformed row of that format and the reason it must be rejected for)
CASES = {
    "glaive": ("glaive_function_calling_v2.json",
               {"system": "SYSTEM: x", "chat": "USER: hi\n\n\nASSISTANT: <functioncall> {\"name\": \"get_weather\", "
                                               "\"arguments\": '{city: Lisbon}'} <|endoftext|>\n"},
               "ASSISTANT turn 2: <functioncall> 'get_weather' arguments are not a JSON object"),
    "opencodeinstruct": ("opencodeinstruct.parquet", {"id": "bad1", "input": "   ", "output": "x"}, "field `input` is empty"),
    "magicoder_oss": ("magicoder_oss_instruct.jsonl", {"lang": "go", "solution": "x"},
                      "missing field `problem` (OSS-Instruct) or `instruction` (Evol-Instruct)"),
    "magicoder_evol": ("magicoder_evol_instruct.jsonl", {"instruction": 3, "response": "x"},
                       "field `instruction` must be a string, got int"),
    "mixture_of_thoughts": ("mixture_of_thoughts.jsonl", {"messages": [{"role": "robot", "content": "x"}]},
                            "`messages[0]`.role must be one of"),
    "ultrachat": ("ultrachat_200k.jsonl", {"prompt_id": "p", "messages": [{"role": "assistant", "content": "only me"}]},
                  "has no user turn"),
    "openthoughts": ("openthoughts_114k.jsonl", {"system": "s", "conversations": [{"from": "user"}]},
                     "`conversations[0]`.value must be a string"),
    "sharegpt": ("sharegpt.json", {"id": "b", "conversations": [{"from": "narrator", "value": "x"}]},
                 "`conversations[0]`.from 'narrator' is not a known speaker"),
    "swe_agent": ("swe_agent_trajectories.jsonl", {"instance_id": "i", "trajectory": [{"role": "ai", "text": None}]},
                  "`trajectory[0]`.text must be a string"),
    "openai": ("openai_messages.jsonl", {"id": "b", "messages": [{"role": "user", "content": "x"},
                                                               {"role": "assistant", "tool_calls": [{"function": {}}]}]},
               "`messages[1]`.tool_calls[0].function.name is missing"),
}
FMT = {"magicoder_oss": "magicoder", "magicoder_evol": "magicoder"}


def _fmt(case: str) -> str:
    return FMT.get(case, case)


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))
    return [json.loads(line) for line in path.open(encoding="utf-8")]


def _write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    else:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _load(name: str):
    f, _, _ = CASES[name]
    ps = load_prompts(FIX / f, format=_fmt(name))
    assert ps.rejected == [] and ps.prompts, ps.skipped
    return ps


def test_every_registered_format_has_a_fixture_and_the_params_demo_uses_each():
    assert set(FORMATS) == {_fmt(c) for c in CASES} | {"prompts"}
    demo = (REPO / "params" / "formats_demo.yaml").read_text()
    for f, *_ in CASES.values():
        assert f"tests/fixtures/formats/{f}" in demo


def test_glaive_functions_become_tools_calls_become_tool_calls_and_responses_tool_turns():
    ps = _load("glaive")
    weather, tip, plain = ps.prompts
    assert [t["function"]["name"] for t in weather.tools] == ["get_weather"]
    assert weather.tools[0]["function"]["parameters"]["required"] == ["city"]
    assert [t["function"]["name"] for t in tip.tools] == ["get_weather", "calculate_tip"]
    assert plain.tools is None and plain.messages[0]["content"] == "You are a helpful assistant, with no access to external functions."
    roles = [m["role"] for m in weather.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    call = weather.messages[2]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Lisbon"}
    assert weather.messages[3]["tool_call_id"] == call["id"] and json.loads(weather.messages[3]["content"])["sky"] == "clear"
    assert all("<|endoftext|>" not in m["content"] for m in weather.messages)
    assert weather.meta["reference_reply"].startswith("A light jacket")  # the trailing reply, cut off
    assert [m["role"] for m in weather.conversation][-1] == "assistant" and len(weather.conversation) == 7
    assert weather.messages[0]["content"].endswith("Use them if required")  # the JSON is in tools, not in the text


def test_opencodeinstruct_parquet_and_jsonl_read_the_same_with_the_card_id():
    pq_set = _load("opencodeinstruct")
    jl_set = load_prompts(FIX / "opencodeinstruct.jsonl", format="opencodeinstruct")
    assert [(p.sample_id, p.messages) for p in pq_set.prompts] == [(p.sample_id, p.messages) for p in jl_set.prompts]
    p = pq_set.prompts[0]
    assert p.sample_id == "0f3a9c5e1b2d4e6f8a7b9c0d1e2f3a4b"
    assert p.messages == [{"role": "user", "content": p.messages[0]["content"]}] and "clamp" in p.messages[0]["content"]
    assert p.meta["domain"] == "generic" and "def clamp" in p.meta["reference_reply"]
    assert pq_set.rows == 3 and str(pq_set.path).endswith(".parquet")


def test_magicoder_reads_both_column_pairs():
    oss, evol = _load("magicoder_oss"), _load("magicoder_evol")
    assert "math.pi" in oss.prompts[0].messages[0]["content"] and oss.prompts[0].meta["lang"] == "python"
    assert "import math" in oss.prompts[0].meta["reference_reply"]
    assert evol.prompts[0].messages[0]["content"].startswith("Write a short SQL query")
    assert "SELECT" in evol.prompts[0].meta["reference_reply"]
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in oss.prompts + evol.prompts)


def test_mixture_of_thoughts_and_openthoughts_keep_the_reasoning_reply_as_reference():
    mot = _load("mixture_of_thoughts").prompts[0]
    assert mot.messages == [{"role": "user", "content": "What is 17 times 6? Answer briefly."}]
    assert "<think>" in mot.meta["reference_reply"] and mot.meta["source"] == "fixture/math"
    ot = _load("openthoughts").prompts[0]
    assert [m["role"] for m in ot.messages] == ["system", "user"]
    assert ot.messages[0]["content"].startswith("Your role as an assistant")
    assert "<|begin_of_thought|>" in ot.meta["reference_reply"]


def test_ultrachat_id_is_prompt_id_and_earlier_turns_stay():
    p = _load("ultrachat").prompts[0]
    assert p.sample_id.startswith("3b9e0d6c")
    assert [m["role"] for m in p.messages] == ["user", "assistant", "user"]
    assert len(p.conversation) == 4 and p.conversation[:3] == p.messages


def test_sharegpt_speakers_system_and_llama_factory_tool_turns():
    ps = _load("sharegpt")
    by = {p.sample_id: p for p in ps.prompts}
    assert [m["role"] for m in by["QWJ3kLm_0"].messages] == ["user", "assistant", "user"]
    assert by["Zp0sYt9_0"].messages[0] == {"role": "system", "content": "You answer in French."}
    t = by["tool_row_1"]
    assert t.tools[0]["function"]["name"] == "get_price"  # `tools` was JSON text
    assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool"]
    call = t.messages[2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"ticker": "AAPL"} and t.messages[3]["tool_call_id"] == call["id"]


def test_swe_agent_trajectory_keeps_every_step_and_cuts_the_last_action():
    p = _load("swe_agent").prompts[0]
    roles = [m["role"] for m in p.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]  # observations are user turns
    assert p.messages[0]["content"].startswith("SETTING:") and "submit" in p.meta["reference_reply"]
    assert p.meta["instance_id"] == "octo__widgets-101" and p.meta["target"] is True
    assert len(p.conversation) == 7


def test_openai_messages_tool_calls_tool_turns_and_content_parts():
    by = {p.sample_id: p for p in _load("openai").prompts}
    p = by["conv-001"]
    assert [m["role"] for m in p.messages] == ["system", "user", "assistant", "tool"] and "reference_reply" not in p.meta
    assert p.messages[2]["content"] == "" and p.messages[2]["tool_calls"][0]["id"] == "call_a1"
    assert p.messages[3]["tool_call_id"] == "call_a1" and p.tools[0]["function"]["name"] == "convert_units"
    assert by["conv-002"].messages == [{"role": "user", "content": "Name three primary colours."}]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_row_is_rejected_with_its_location_and_reason(case, tmp_path):
    f, bad, reason = CASES[case]
    src = FIX / f
    rows = _rows(src)
    if src.suffix == ".parquet":  # a parquet file has one schema: the bad row keeps its columns
        bad = {**{k: None for k in rows[0]}, **bad}
    dst = _write(tmp_path / src.name, rows[:1] + [bad] + rows[1:])
    ps = load_prompts(dst, format=_fmt(case))
    assert len(ps.prompts) == len(rows) and len(ps.rejected) == 1, ps.skipped
    where = f"{dst}:2" if src.suffix == ".jsonl" else f"{dst} row 2"
    assert ps.skipped[0].startswith(f"{where}: ") and reason in ps.skipped[0], ps.skipped[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_sample_ids_are_stable_when_the_rows_are_shuffled(case, tmp_path):
    f, _, _ = CASES[case]
    src = FIX / f
    rows = _rows(src)
    order = list(range(len(rows)))
    random.Random(7).shuffle(order)
    if order == sorted(order):
        order.reverse()
    a = load_prompts(src, format=_fmt(case))
    b = load_prompts(_write(tmp_path / src.name, [rows[i] for i in order]), format=_fmt(case))
    assert {p.sample_id: p.messages for p in a.prompts} == {p.sample_id: p.messages for p in b.prompts}
    assert [p.sample_id for p in a.prompts] != [p.sample_id for p in b.prompts] or len(rows) == 1


def test_exact_duplicate_prompts_are_dropped_with_a_reason_and_counted(tmp_path):
    rows = _rows(FIX / "mixture_of_thoughts.jsonl")
    other_reply = {**rows[0], "messages": [rows[0]["messages"][0], {"role": "assistant", "content": "102."}]}
    ps = load_prompts(_write(tmp_path / "m.jsonl", rows + [other_reply]), format="mixture_of_thoughts")
    assert len(ps.prompts) == 2 and ps.duplicates == 1 and ps.malformed == 0 and ps.rejected_share == 0
    assert ps.skipped[0].startswith(f"{tmp_path / 'm.jsonl'}:3: duplicate prompt: the same messages and tools as sample_id")
    assert "(first on line 1)" in ps.skipped[0]


def test_a_folder_of_parquet_shards_is_read_through_datasets_by_split(tmp_path):
    rows = _rows(FIX / "ultrachat_200k.jsonl")
    data = tmp_path / "ultrachat_200k" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:1]), data / "train_sft-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1:]), data / "train_sft-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows), data / "test_sft-00000-of-00001.parquet")
    ps = load_prompts(tmp_path / "ultrachat_200k", format="ultrachat", split="train_sft")
    assert ps.rows == 2 and [p.sample_id for p in ps.prompts] == [r["prompt_id"] for r in rows]
    assert check_source(str(tmp_path / "ultrachat_200k"), "ultrachat", split="train_sft") is None


def test_a_folder_of_jsonl_shards_keeps_line_locations(tmp_path):
    (tmp_path / "shards").mkdir()
    rows = _rows(FIX / "openai_messages.jsonl")
    _write(tmp_path / "shards" / "part-0.jsonl", rows[:1])
    (tmp_path / "shards" / "part-1.jsonl").write_text(json.dumps(rows[1]) + "\n{\"id\": \"x\", \"messages\": [\n")
    ps = load_prompts(tmp_path / "shards", format="openai")
    assert len(ps.prompts) == 2 and ps.skipped == [f"{tmp_path / 'shards' / 'part-1.jsonl'}:2: " + ps.rejected[0].reason]
    assert "the line is cut off" in ps.skipped[0]


def test_wrong_format_is_named_with_the_format_the_rows_look_like():
    why = check_source(str(FIX / "ultrachat_200k.jsonl"), "sharegpt")
    assert why and str(FIX / "ultrachat_200k.jsonl") in why and "reads `conversations`" in why and "ultrachat" in why
    why = check_source(str(FIX / "opencodeinstruct.parquet"), "magicoder")
    assert why and "`problem` or `instruction`" in why and "opencodeinstruct" in why


def test_tool_calls_reach_a_template_without_tools_support_as_the_json_it_asks_for(smollm2_tokenizer):
    p = _load("glaive").prompts[0]
    msgs, tools = messages_for_template(p, SMOLLM2)
    assert tools is None and "get_weather" in msgs[0]["content"]
    call = json.loads(msgs[2]["content"])
    assert call == {"name": "get_weather", "arguments": {"city": "Lisbon"}} and "tool_calls" not in msgs[2]
    assert "tool_calls" in p.messages[2]  # the prompt itself is not modified


def test_prompts_command_shows_rejections_and_writes_prompts_that_read_back(tmp_path):
    src = FIX / "sharegpt.json"
    rows = _rows(src) + [{"id": "b", "conversations": [{"from": "narrator", "value": "x"}]}]
    f = _write(tmp_path / "s.json", rows)
    out = tmp_path / "norm.jsonl"
    proc = subprocess.run([sys.executable, "-m", "eagle3data", "prompts", str(f), "--format", "sharegpt", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 rows -> 3 prompts; 1 rejected" in proc.stdout
    assert f"{f} row 4: `conversations[0]`.from 'narrator'" in proc.stdout
    back = load_prompts(out, format="prompts")
    orig = load_prompts(src, format="sharegpt")
    assert [(p.sample_id, p.messages, p.tools, p.meta) for p in back.prompts] == \
        [(p.sample_id, p.messages, p.tools, p.meta) for p in orig.prompts]
    assert back.prompts[0].conversation == orig.prompts[0].conversation
    bad = subprocess.run([sys.executable, "-m", "eagle3data", "prompts", str(tmp_path / "nope.jsonl"), "--format", "openai"],
                         cwd=REPO, capture_output=True, text=True)
    # through cli.main's one error mapping, as every command: one line on stderr, exit 2, nothing on stdout
    assert bad.returncode == 2 and not bad.stdout and bad.stderr.strip().splitlines() == [
        f"error: prompt file not found: {tmp_path / 'nope.jsonl'}"], bad.stdout + bad.stderr
    unknown = subprocess.run([sys.executable, "-m", "eagle3data", "prompts", str(f), "--format", "nosuch"],
                             cwd=REPO, capture_output=True, text=True)
    assert unknown.returncode == 2 and not unknown.stdout and unknown.stderr.strip().splitlines() == [
        f"error: unknown dataset format 'nosuch'; known: {', '.join(FORMATS)}"], unknown.stdout + unknown.stderr


@pytest.mark.slow
def test_formats_demo_runs_through_01_to_03_with_one_dataset_of_each_format(tmp_path):
    from eagle3data.core.params import load_params

    cmd = [sys.executable, "-m", "eagle3data", "run", "params/formats_demo.yaml", "--only", "01", "--only", "02",
           "--only", "03", "-p", "output_root", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "formats_demo"
    params = load_params(REPO / "params" / "formats_demo.yaml")
    ledger = json.loads((run / "ledger.json").read_text())
    for d in params.datasets:
        recs = [json.loads(line) for line in (run / "records" / f"{d.name}.jsonl").open()]
        assert recs and all(r["ids_exact"] and r["output_ids"] for r in recs), d.name
        assert ledger["datasets"][d.name]["rejected_prompt_lines"] == []
    glaive = [json.loads(line) for line in (run / "records" / "glaive.jsonl").open()]
    assert any(r["tools"] and any(m.get("tool_calls") for m in r["messages"]) for r in glaive)
    assert (run / "audit" / "verdicts.jsonl").exists() and (run / "report.html").exists()
