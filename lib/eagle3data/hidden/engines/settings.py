"""What in a serving engine's settings would cut or alter 04's states, read before the first sample (issue 52).

SGLang (`/get_server_info`): chunked prefill (`chunked_prefill_problem`; 04's servers run `--chunked-prefill-size -1`,
`generate/backends/sglang_server.sglang_command(chunked_prefill=False)`) beside the radix cache the pass checks.
vLLM (`/v1/models`, `/metrics`' `vllm:cache_config_info`): a context shorter than the longest sample, prefix caching
(`settings_problem`; 04's server runs `PREFIX_CACHING_OFF`).
"""

from __future__ import annotations

import re
from typing import Any

# Prefix caching reuses a cached prefix's blocks instead of computing them: the hidden states of those tokens are
# not the request's own forward's (vLLM issue #44485: with it on, the file holds fewer rows than the prompt). 04's
# server runs without it, and a server started elsewhere that publishes it on is refused before the first sample.
PREFIX_CACHING_OFF = "--no-enable-prefix-caching"


# Chunked prefill splits a prompt over several forwards and SGLang returns only the last chunk's hidden states (a
# 194-token sample came back with 34 rows). The split does not wait for a prompt longer than the chunk: a prompt
# admitted into a prefill batch gets what is left of the batch's chunk budget (SGLang 0.5.23's PrefillAdder), so any
# sample can be cut while others are in flight. 04's servers run with it off (SpecForge's capture server does too):
# `sglang_command(chunked_prefill=False)`.


def chunked_prefill_problem(info: dict[str, Any], longest: int, concurrency: int) -> str | None:
    """Why a server's chunked prefill (`/get_server_info`'s resolved `chunked_prefill_size`) would cut a sample's
    states, or None: off (-1, or none), or (one request in flight) a chunk at least the mix's longest sample."""
    size = info.get("chunked_prefill_size")
    if not isinstance(size, int) or size <= 0:
        return None
    if concurrency == 1 and size >= longest:
        return None
    why = (f"the mix's longest sample has {longest} tokens" if size < longest else
           f"with {concurrency} requests in flight a prompt gets what is left of a prefill batch's chunk")
    return (f"runs with chunked prefill on (chunked_prefill_size {size}; {why}): a prompt split over chunks returns "
            "only its last chunk's hidden states; start it with --chunked-prefill-size -1")


def cache_config_info(metrics: str) -> dict[str, str] | None:
    """The labels of `vllm:cache_config_info` in a `/metrics` page (vLLM's CacheConfig as strings), or None."""
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            body = line[len("vllm:cache_config_info{"): line.rfind("}")]
            return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', body))
    return None


def settings_problem(cache: dict[str, str] | None, max_model_len: Any, longest: int, *, launched: bool) -> str | None:
    """Why a vLLM server's settings would cut or alter 04's states (one line naming the flag), or None."""
    if isinstance(max_model_len, int) and longest > max_model_len:
        return (f"its max_model_len {max_model_len} is shorter than the mix's longest sample ({longest} tokens): "
                f"start it with --max-model-len {longest} or more")
    if cache is None:
        return ("publishes no vllm:cache_config_info on /metrics, so 04 cannot check its prefix caching (a server 04 "
                "launched must)") if launched else None
    if cache.get("enable_prefix_caching") == "True":
        return ("runs with prefix caching on (vllm:cache_config_info enable_prefix_caching=\"True\"): a cached "
                "prefix's rows are not the request's own forward (vLLM issue #44485); start it with "
                f"{PREFIX_CACHING_OFF}")
    return None
