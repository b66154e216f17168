"""A model's final norm outside the model: its kind by the config's `model_type` (`rms`: w·x/rms(x), or `rms_1p`:
(1+w)·x/rms(x)), its weight and eps read from the checkpoint alone (`read_final_norm`), and the norm itself
(`rms_norm`).

One reader for the two places that apply the final norm outside the model: the vLLM backend's post-norm state
(`engines.vllm_capture.final_norm`) and verify-hidden's head (`verify.head.load_head`). The kinds are checked against
transformers' own norm classes in tests/test_hidden_vllm.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from eagle3data.core.models import text_config

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
    return NORM_KINDS.get(getattr(text_config(config), "model_type", None))


def norm_eps(config: Any) -> float | None:
    """The final norm's eps from the text config (`rms_norm_eps`, else `layer_norm_epsilon`); None if it has neither."""
    text = text_config(config)
    got = [getattr(text, name, None) for name in ("rms_norm_eps", "layer_norm_epsilon")]
    return next((float(e) for e in got if e is not None), None)


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (through `model.safetensors.index.json` when sharded)."""
    folder = Path(folder)
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        return {k: folder / v for k, v in orjson.loads(idx.read_bytes())["weight_map"].items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


@dataclass(frozen=True)
class FinalNorm:
    """The final norm as read from a checkpoint: its tensor's name, the multiplier (fp32: `w`, or `1 + w` for the
    `rms_1p` kind) and eps (None when the config gives none)."""

    name: str
    multiplier: Any
    eps: float | None


def read_final_norm(folder: str | Path, config: Any, where: dict[str, Path] | None = None) -> FinalNorm | None:
    """The final norm's weight of a checkpoint, read alone from its safetensors files (`where`: `weight_files`,
    when the caller has it), or None when it holds no `model.norm.weight` (else `.norm.weight`) outside the layers
    of the text config's hidden size. A model type whose kind is not known is read as `rms`."""
    import torch
    from safetensors import safe_open

    where = weight_files(folder) if where is None else where
    hidden = getattr(text_config(config), "hidden_size", None)
    for suffix in ("model.norm.weight", ".norm.weight"):
        cands = sorted((n for n in where if n.endswith(suffix) and "layers." not in n), key=len)
        for name in cands:
            with safe_open(str(where[name]), framework="pt") as f:
                w = f.get_tensor(name).to(torch.float32)
            if hidden is None or tuple(w.shape) == (int(hidden),):  # a vision tower's norm has another size
                mult = 1.0 + w if known_norm_kind(config) == "rms_1p" else w
                return FinalNorm(name, mult, norm_eps(config))
    return None


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """`weight * x / sqrt(mean(x^2) + eps)` in fp32 (`weight`: `FinalNorm.multiplier`)."""
    import torch

    x = x.to(torch.float32)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
