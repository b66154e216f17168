"""Prompt loader: bad lines are rejected with file:line and reason; good lines are kept."""

import json

from eagle3data.profiles import QWEN3, SMOLLM2
from eagle3data.prompts import Prompt, builtin_datasets, load_prompts, messages_for_template, template_prompt

GOOD = {"sample_id": 1, "messages": [{"role": "user", "content": "hi"}]}


def test_bad_lines_are_reported_with_file_line_and_reason_and_loading_continues(tmp_path):
    f = tmp_path / "set.jsonl"
    lines = [
        json.dumps(GOOD),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "x"}]}),
        json.dumps({"sample_id": 3, "messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"sample_id": 4, "messages": []}),
        json.dumps(GOOD),  # duplicate sample_id
        "",
        json.dumps({"sample_id": 5, "messages": [{"role": "user", "content": "ok"}], "tools": "nope"}),
        json.dumps({"sample_id": 6, "messages": [{"role": "user", "content": "last good"}]}),
    ]
    f.write_text("\n".join(lines) + "\n")
    ps = load_prompts(f)
    assert [p.sample_id for p in ps.prompts] == [1, 6]
    assert len(ps.skipped) == 6
    assert ps.skipped[0].startswith(f"{f}:2: not valid JSON")
    assert ps.skipped[1] == f"{f}:3: missing field `sample_id`"
    assert f"{f}:4: field `messages[0].role`" in ps.skipped[2]
    assert f"{f}:5: field `messages` must be a non-empty list" == ps.skipped[3]
    assert f"{f}:6: duplicate sample_id 1 (first on line 1)" == ps.skipped[4]
    assert f"{f}:8: field `tools` must be a list" == ps.skipped[5]


def test_builtin_sets_cover_the_eight_categories_and_sample_1601():
    names = builtin_datasets()
    assert len(names) == 8 and names[0] == "b1_glaive" and names[-1] == "b8_sweagent"
    for n in names:
        ps = load_prompts(f"builtin:{n}")
        assert ps.skipped == [] and len(ps.prompts) >= 3
    glaive = {p.sample_id: p for p in load_prompts("builtin:b1_glaive").prompts}
    p = glaive[1601]
    assert p.tools and p.tools[0]["function"]["name"] == "check_website_status"
    assert "http" not in p.messages[-1]["content"]  # the user gives no address


def test_tools_go_into_the_system_prompt_when_the_template_has_no_tools():
    tools = [{"type": "function", "function": {"name": "check_website_status", "parameters": {}}}]
    p = Prompt("b1", 1, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "up?"}], tools)
    msgs, t = messages_for_template(p, SMOLLM2)
    assert t is None and msgs[0]["content"].startswith("Be brief.") and "check_website_status" in msgs[0]["content"]
    assert p.messages[0]["content"] == "Be brief."  # the source prompt is not modified
    msgs, t = messages_for_template(p, QWEN3)
    assert t == tools and msgs[0]["content"] == "Be brief."


def test_template_prompt_ends_with_the_generation_prompt(smollm2_tokenizer):
    p = Prompt("b", 1, [{"role": "user", "content": "What is 2+2?"}])
    ids = template_prompt(smollm2_tokenizer, p, SMOLLM2)
    assert smollm2_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert ids.count(SMOLLM2.end_of_turn.id) == 2  # default system turn + user turn
