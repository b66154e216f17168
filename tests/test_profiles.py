"""Profiles: ids match the tokenizer they are used with, and the EAGLE-3 layer rule."""

import dataclasses

import pytest

from eagle3data.core.profiles import KIMI_K25, PROFILES, QWEN3, SMOLLM2, ProfileError, Token, aux_layers, get_profile


def test_smollm2_profile_matches_embedded_tokenizer(smollm2_tokenizer):
    SMOLLM2.check_tokenizer(smollm2_tokenizer)  # raises on any mismatch


def test_profile_with_a_wrong_id_is_a_clear_error_naming_both(smollm2_tokenizer):
    wrong = dataclasses.replace(SMOLLM2, end_of_turn=Token("<|im_end|>", 1))
    with pytest.raises(ProfileError) as e:
        wrong.check_tokenizer(smollm2_tokenizer)
    msg = str(e.value)
    assert "id 1 should be '<|im_end|>'" in msg and "'<|im_start|>'" in msg and "smollm2" in msg


def test_kimi_profile_against_a_foreign_vocabulary_fails(smollm2_tokenizer):
    with pytest.raises(ProfileError, match="kimi-k2.5"):
        KIMI_K25.check_tokenizer(smollm2_tokenizer)


def test_reference_ids_of_kimi_and_qwen3():
    assert KIMI_K25.end_of_turn.id == 163586 and KIMI_K25.guard.id == 163585
    assert (KIMI_K25.reasoning_open.id, KIMI_K25.reasoning_close.id) == (163606, 163607)
    assert KIMI_K25.stop_ids == [163586, 163585]
    assert [t.id for t in KIMI_K25.tool_calls.tokens()] == [163595, 163597, 163598, 163599, 163596]
    assert (QWEN3.end_of_turn.id, QWEN3.reasoning_open.id, QWEN3.reasoning_close.id) == (151645, 151667, 151668)
    assert (QWEN3.tool_calls.call_begin.id, QWEN3.tool_calls.call_end.id) == (151657, 151658)


def test_aux_layer_rule_both_conventions():
    k = aux_layers(61)
    assert k.hf_indices == (2, 30, 58) and k.layer_outputs == (1, 29, 57)
    s = SMOLLM2.aux_layers()
    assert s.hf_indices == (2, 15, 27) and s.layer_outputs == (1, 14, 26)
    with pytest.raises(ValueError):
        aux_layers(4)


def test_unknown_profile_lists_known_ones():
    with pytest.raises(KeyError, match="kimi-k2.5"):
        get_profile("llama")
    assert set(PROFILES) == {"smollm2", "qwen3", "kimi-k2.5"}
