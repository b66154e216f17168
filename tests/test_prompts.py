"""Prompt loader: bad lines are rejected with file:line and reason; good lines are kept."""

import json

from eagle3data.core.profiles import QWEN3, SMOLLM2
from eagle3data.prompts.load import Prompt, load_prompts, messages_for_template, template_prompt, template_prompts
from eagle3data.prompts.files import builtin_datasets

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
    names = builtin_datasets()  # the eight demo categories, then 06's training set (v1_stdlib_tasks)
    assert len(names) == 9 and names[0] == "b1_glaive" and names[7] == "b8_sweagent"
    assert names[8] == "v1_stdlib_tasks" and len(load_prompts("builtin:v1_stdlib_tasks").prompts) == 2251
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


# ---- loud bad input (issue 13): cut-off lines, wrong file types, missing and empty files, the run stop

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def _ci_params(tmp_path, datasets):
    from eagle3data.core.params import load_params

    return load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path / "out"), "datasets": datasets})


def test_a_line_cut_in_half_says_the_line_is_cut_off(tmp_path):
    f = tmp_path / "cut.jsonl"
    whole = json.dumps({"sample_id": 2, "messages": [{"role": "user", "content": "a complete line"}]})
    f.write_text(json.dumps(GOOD) + "\n" + whole[:40] + "\n" + whole + "\n" + whole.replace('"2', '"3')[:25])
    ps = load_prompts(f)
    assert [p.sample_id for p in ps.prompts] == [1, 2]
    assert ps.skipped[0].startswith(f"{f}:2: not valid JSON: the line is cut off")
    assert ps.skipped[1].startswith(f"{f}:4: not valid JSON: the line is cut off")  # the last line, no newline
    assert "control character" not in " ".join(ps.skipped)


def test_params_validation_names_a_missing_file_and_a_parquet_file_named_jsonl(tmp_path):
    import pytest

    from eagle3data.core.params import ParamsError
    from eagle3data.prompts.load import check_dataset_files

    parquet_as_jsonl = tmp_path / "oci.jsonl"
    parquet_as_jsonl.write_bytes((REPO / "tests/fixtures/formats/opencodeinstruct.parquet").read_bytes())
    p = _ci_params(tmp_path, [{"name": "a", "path": str(tmp_path / "missing.jsonl")},
                              {"name": "b", "path": str(parquet_as_jsonl), "format": "opencodeinstruct"},
                              {"name": "c", "path": "builtin:b1_glaive"}])
    with pytest.raises(ParamsError) as e:
        check_dataset_files(p)
    lines = str(e.value).splitlines()
    assert lines == [f"datasets.0 (a, format prompts): prompt file not found: {tmp_path / 'missing.jsonl'}",
                     f"datasets.1 (b, format opencodeinstruct): {parquet_as_jsonl}: is a parquet file, not JSON text "
                     "(rename it to .parquet)"]
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ParamsError, match="empty.jsonl: the file is empty"):
        check_dataset_files(_ci_params(tmp_path, [{"name": "e", "path": str(tmp_path / "empty.jsonl")}]))
    with pytest.raises(ParamsError, match="unknown dataset format 'alpaca'"):
        _ci_params(tmp_path, [{"name": "x", "path": "builtin:b1_glaive", "format": "alpaca"}])


def test_zero_usable_prompts_or_too_many_rejected_stop_the_run_and_print_the_reasons(tmp_path, capsys):
    import pytest

    from eagle3data.generate.plan import _check_prompt_sets
    from eagle3data.prompts.load import load_datasets
    from eagle3data.prompts.files import PromptDataError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"sample_id": 1, "messages": [{"role": "user", "content": "cut\n{"sample_id": 2}\n')
    p = _ci_params(tmp_path, [{"name": "bad", "path": str(bad)}])
    with pytest.raises(PromptDataError) as e:
        _check_prompt_sets(p, load_datasets(p))
    assert f"dataset bad: no usable prompt in {bad} (format prompts, 2 rows, 2 rejected); first: {bad}:1: not valid JSON: " \
           "the line is cut off" in str(e.value)
    out = capsys.readouterr().out
    assert "prompts bad: 2 of 2 rows rejected (100%)" in out and f"{bad}:2: missing field `messages`" in out.replace(
        "field `messages` must be a non-empty list", "missing field `messages`")

    half = tmp_path / "half.jsonl"
    half.write_text(json.dumps(GOOD) + "\n{oops\n")
    p = _ci_params(tmp_path, [{"name": "half", "path": str(half), "max_rejected_share": 0.4}])
    with pytest.raises(PromptDataError, match=r"dataset half: 1 of 2 rows rejected \(50%\) .* more than max_rejected_share 0.4"):
        _check_prompt_sets(p, load_datasets(p))
    p = _ci_params(tmp_path, [{"name": "half", "path": str(half), "max_rejected_share": 0.5}])
    _check_prompt_sets(p, load_datasets(p))  # at the limit: runs, and says what it rejected
    assert f"prompts half: 1 of 2 rows rejected (50%)" in capsys.readouterr().out


def test_headless_generate_exits_non_zero_with_one_line_for_an_unusable_dataset(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"sample_id": 1, "messages": [{"role": "us\n')  # the one line is cut off
    proc = subprocess.run([sys.executable, "-m", "eagle3data", "generate", "params/ci.yaml", "--quiet",
                           "-p", "output_root", str(tmp_path / "out"),
                           "-p", "datasets", json.dumps([{"name": "bad", "path": str(bad)}])],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()  # the preflight reads the first rows: caught before any work
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: datasets.0 (bad, format prompts): {bad}: its one row is rejected as format "
                               f"`prompts` (first: {bad}:1: not valid JSON: the line is cut off"), lines[0]
    assert not (tmp_path / "out" / "ci" / "records" / "bad.jsonl").exists()


def test_batched_templating_gives_the_ids_of_apply_chat_template(qwen, smollm2_tokenizer):
    """The engine templates prompts in chunks (`template_prompts`: render each, one encode call); its ids
    must be exactly what `apply_chat_template(tokenize=True)` gives one prompt at a time, on the real
    vocabularies, for multi-turn prompts with tools, tool calls and results, unicode and added-token text."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    prompts = [
        Prompt("d", 0, [{"role": "user", "content": "Naïve café — 2+2? 日本語で答えて 🙂"}]),
        Prompt("d", 1, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello! How can I help?"},
                        {"role": "user", "content": "Write `<|im_end|>` literally.\n\n  indented\ttab"}]),
        Prompt("d", 2, [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": "", "tool_calls": [
                            {"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"},
                        {"role": "user", "content": "And tomorrow?"}], tools=tools),
    ]
    for tok, profile in ((qwen, QWEN3), (smollm2_tokenizer, SMOLLM2)):
        one_by_one = []
        for p in prompts:
            msgs, tls = messages_for_template(p, profile)
            kwargs = dict(profile.template_kwargs, **({"tools": tls} if tls else {}))
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
            one_by_one.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
        assert template_prompts(tok, prompts, profile) == one_by_one
        assert [template_prompt(tok, p, profile) for p in prompts] == one_by_one
        assert template_prompts(tok, [], profile) == []


def test_lines_the_fast_parser_refuses_read_as_the_stdlib_reads_them(tmp_path):
    """Prompt lines go through orjson, and through the stdlib `json` where orjson refuses: an escaped lone
    surrogate (in scraped chat text), an integer past 64 bits, NaN in a meta field read the same as before."""
    f = tmp_path / "set.jsonl"
    lines = ['{"sample_id": 1, "messages": [{"role": "user", "content": "emoji cut in half: \\ud83d end"}]}',
             '{"sample_id": 123456789012345678901234567890, "messages": [{"role": "user", "content": "big id"}]}',
             '{"sample_id": 3, "messages": [{"role": "user", "content": "Grüße 🙂"}], "meta": {"score": NaN}}']
    f.write_text("\n".join(lines) + "\n")
    ps = load_prompts(f)
    assert not ps.skipped
    assert [p.messages[0]["content"] for p in ps.prompts] == [json.loads(x)["messages"][0]["content"] for x in lines]
    assert ps.prompts[1].sample_id == 123456789012345678901234567890


def test_01s_plan_holds_of_a_last_turn_prompt_only_what_it_sends(tmp_path):
    """turns: last sends a prompt's messages and tools and journals neither the row's other turns nor its
    card fields (`meta`, the dataset's own reply among them): the plan drops both, so 01 holds at 88,000
    prompts what it sends. turns: all replays the row's turns, so its conversations are kept whole."""
    from eagle3data.generate.plan import plan_run
    from eagle3data.prompts.load import load_prompts

    src = REPO / "tests/fixtures/formats/ultrachat_200k.jsonl"
    whole = {p.sample_id: p for p in load_prompts(src, "u", "ultrachat").prompts}
    assert any(p.meta.get("reference_reply") for p in whole.values())
    assert any(p.conversation for p in whole.values())  # the fixture has multi-turn rows
    last = plan_run(_ci_params(tmp_path, [{"name": "u", "path": str(src), "format": "ultrachat"}]), None, None,
                    template=False)
    assert {p.sample_id for p, _ in last.pending} == set(whole)
    for p, ids in last.pending:
        assert ids is None and p.meta == {} and p.conversation is None
        assert (p.messages, p.tools) == (whole[p.sample_id].messages, whole[p.sample_id].tools)
    every = plan_run(_ci_params(tmp_path / "b", [{"name": "u", "path": str(src), "format": "ultrachat",
                                                  "turns": "all"}]), None, None, template=False)
    assert {sid: c.prompt.conversation for (_, sid), c in every.conversations.items()} == \
        {str(k): p.conversation for k, p in whole.items()}
