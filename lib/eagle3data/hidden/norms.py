"""The kind of a model's final norm, by its config's `model_type`: `rms` (w·x/rms(x)) or `rms_1p` ((1+w)·x/rms(x)).

One table for the two places that apply the final norm outside the model: the vLLM backend's post-norm state
(`vllm_capture.final_norm`) and verify-hidden's head (`verify_head.load_head`). Checked against
transformers' own norm classes in tests/test_hidden_vllm.py.
"""

from __future__ import annotations

from typing import Any

NORM_KINDS = {
    **dict.fromkeys(("llama", "mistral", "ministral", "ministral3", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                     "qwen3_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_linear", "glm",
                     "glm4", "glm4_moe", "gpt_oss", "granite", "granitemoe", "granitemoeshared", "phi3", "olmo2",
                     "olmo3", "olmoe", "minimax", "minimax_m2", "smollm3", "ernie4_5", "ernie4_5_moe", "exaone4",
                     "hunyuan_v1_dense", "hunyuan_v1_moe", "seed_oss", "llama4_text", "longcat_flash", "dots1",
                     "gemma3n_text", "apertus", "arcee", "jamba", "kimi_k25"), "rms"),  # Kimi-K2.x: DeepSeek-V3's
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
                     "vaultgemma"), "rms_1p"),
}


def known_norm_kind(config: Any) -> str | None:
    """`rms`, `rms_1p`, or None when the model type is not in NORM_KINDS."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return NORM_KINDS.get(getattr(text, "model_type", None))
