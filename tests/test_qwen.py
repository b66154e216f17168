"""The Qwen3 test vocabulary: same ids as the package's own tiktoken encoding, Qwen3 tokens, template."""

from __future__ import annotations

import json

import pytest

from eagle3data.core.profiles import QWEN3

ADVERSARIAL = [
    "e\u0301te\u0301 cafe\u0301 A\u030a",  # combining characters (NFC composes them)
    "family 👨‍👩‍👧‍👦 and flags 🏳️‍🌈 skin 👍🏽",  # emoji, ZWJ sequences, modifiers
    "中文混合English和日本語のテキスト、한국어도 있어요。",  # CJK and mixed scripts
    "Ελληνικά, русский, עברית, العربية mixed in one line",
    "lots of spaces:" + " " * 97 + "end\n\n\n\n\t\t\t  \n",  # long whitespace runs
    "def f(x):\n\tif x:\n\t\treturn x\t# tab\n\treturn None\n",  # code with tabs
    "```\nprint('<|im_end|>')\n```\n<|im_end|>",  # special-token look-alike inside code
    "<think>\nreasoning</think>\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "numbers 1234567890 3.14159 -2e10 0x1F",
    "'s 're 've 'LL 'D contractions, CAPS'S",
]


@pytest.fixture(scope="module")
def qwen_tiktoken():
    from qwen3_vocab import qwen_tiktoken_encoding

    return qwen_tiktoken_encoding()


def test_qwen3_tokens_sit_at_their_ids(qwen):
    QWEN3.check_tokenizer(qwen)  # every profile id decodes to its text
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
                "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666,
                "<think>": 151667, "</think>": 151668}
    assert {t: qwen.convert_tokens_to_ids(t) for t in expected} == expected
    assert len(qwen) == 151669
    assert qwen.eos_token_id == 151645


def test_qwen3_added_tokens_encode_as_single_ids_and_think_is_not_special(qwen):
    ids = qwen.encode("<think>a</think><tool_call><|im_end|>", add_special_tokens=False)
    assert ids[0] == 151667 and ids[-3:] == [151668, 151657, 151645]
    # Qwen3 marks <think>/<tool_call> as added, not special: skip_special_tokens keeps them
    assert qwen.decode(ids, skip_special_tokens=True) == "<think>a</think><tool_call>"


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_qwen3_fast_tokenizer_matches_the_package_tiktoken(qwen, qwen_tiktoken, text):
    assert qwen.encode(text, add_special_tokens=False) == qwen_tiktoken.encode(text)


def test_qwen3_matches_tiktoken_on_the_shipped_prompts(qwen, qwen_tiktoken):
    from eagle3data.prompts.load import load_prompts
    from eagle3data.prompts.files import builtin_datasets

    texts = [m["content"] for name in builtin_datasets() for p in load_prompts(f"builtin:{name}").prompts
             for m in p.messages]
    assert len(texts) >= 40
    got = [e.ids for e in qwen.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    want = [qwen_tiktoken.encode(t) for t in texts]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} texts differ, first: {texts[bad[0]][:200]!r}"


def test_qwen3_normalizes_to_nfc_like_the_package(qwen):
    assert qwen.encode("e\u0301", add_special_tokens=False) == qwen.encode("\u00e9", add_special_tokens=False)


def test_qwen3_template_generation_prompt_leaves_think_to_the_model(qwen):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    on = qwen.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    off = qwen.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert on == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    assert QWEN3.prompt_ends_with_reasoning_open is False


def test_qwen3_template_renders_tools_and_tool_calls(qwen):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"}]
    text = qwen.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<tools>\n" + json.dumps(tools[0]) in text or '"name": "get_weather"' in text
    assert ('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            "\n</tool_call><|im_end|>\n") in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
