"""01's params: the prompt datasets (`datasets:`), sampling, and `generate:` with its backends' sections
(`sglang`, `vllm` with the server it may launch, `openai` with OpenRouter's routing and reasoning)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3data.core.params.base import Strict
from eagle3data.prompts.formats import FORMATS


class DatasetParams(Strict):
    name: str = Field(description="Dataset name; records go to `records/<name>.jsonl`.")
    path: str = Field(
        description="Prompt file (.jsonl, .json, .parquet, .arrow), a folder of shards or a downloaded dataset "
                    "repository, `builtin:<name>` for the shipped prompt sets, or `hf:<owner>/<name>` (needs the hub)."
    )
    format: str = Field("prompts", description="Row format (see docs/01 `Prompt datasets`); `prompts` = this project's JSONL.")
    split: str | None = Field(None, description="Split of a folder or hub dataset (None = `train`), e.g. `train_sft`.")
    subset: str | None = Field(None, description="Config of a folder or hub dataset, e.g. `all` for Mixture-of-Thoughts.")
    limit: int | None = Field(None, gt=0, description="Use at most this many prompts (after the seeded shuffle).")
    max_rejected_share: float = Field(
        0.25, ge=0.0, le=1.0,
        description="Stop the run when more than this share of the rows is rejected (exact duplicates not counted).",
    )
    token_budget: int | None = Field(
        None, gt=0, description="Stop dispatching this dataset when done + reserved in-flight tokens reach it."
    )
    turns: Literal["last", "all"] | None = Field(
        None, description="This dataset's `generate.turns` (None: the run's): `all` regenerates its conversations turn by turn.")

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v not in FORMATS:
            raise ValueError(f"unknown dataset format {v!r}; known: {', '.join(FORMATS)}")
        return v


class SamplingParams(Strict):
    max_new_tokens: int = Field(256, gt=0, description="Most output tokens per response.")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int | None = Field(None, gt=0, description="Top-k sampling (None = off).")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Min-p sampling (None = off).")
    seed: int = Field(0, description="Seed for sampling and for the dispatch shuffle.")


class SGLangServerParams(Strict):
    """An SGLang server the project starts on this machine (`launch: true`; `generate/backends/sglang_server.py`)."""

    python: str = Field(".sglang/bin/python", description="Python of the SGLang venv (`make sglang`; relative paths "
                                                          "from the repository root).")
    host: str = Field("127.0.0.1", description="Address the server listens on.")
    port: int = Field(30000, ge=0, le=65535, description="Port the server listens on (0: a free port).")
    tensor_parallel_size: int = Field(1, gt=0, description="`--tp-size` (GPUs per server).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="`--dtype` (None: model.dtype).")
    context_length: int | None = Field(None, gt=0, description="`--context-length` (None: model.max_context).")
    max_total_tokens: int | None = Field(
        None, gt=0, description="`--max-total-tokens`, the KV cache in tokens (None: 8192 on CPU, where SGLang would "
                                "size it from the free memory; SGLang's own on a GPU).")
    mem_fraction_static: float | None = Field(None, gt=0, le=1, description="`--mem-fraction-static` (GPU).")
    radix_cache: bool = Field(True, description="SGLang's prefix cache (01); 04's servers always run without it (a "
                                                "cached prefix leaves its rows out of the hidden states).")
    start_timeout_s: float = Field(900.0, gt=0, description="Longest wait for the server's /health after starting it.")
    extra_args: list[str] = Field(default_factory=list, description="More `sglang.launch_server` flags, as given.")


class SGLangParams(Strict):
    base_url: str | None = Field(
        None, description="SGLang server or sglang-router URL, e.g. http://127.0.0.1:30000 (None with `launch`: the "
                          "started server's).")
    launch: bool = Field(False, description="Start an SGLang server on this machine for the run (`server`), stop it "
                                            "after.")
    server: SGLangServerParams = Field(default_factory=SGLangServerParams, description="The server `launch` starts.")
    batch_size: int = Field(1, gt=0, le=256, description="Prompts per /generate request (input_ids as a list).")
    check_model: bool = Field(True, description="Refuse to start if /get_model_info names another model.")

    @model_validator(mode="after")
    def _url_or_launch(self) -> "SGLangParams":
        if self.base_url is None and not self.launch:
            raise ValueError("an SGLang server needs `base_url` (a running one) or `launch: true` (one started here)")
        return self


class VLLMServerParams(Strict):
    """A vLLM server the project starts on this machine (`launch: true`; `generate/backends/vllm_server.py`)."""

    python: str = Field(".engine/bin/python", description="Python of the engine venv (`make engine`; relative paths "
                                                          "from the repository root).")
    host: str = Field("127.0.0.1", description="Address the server listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the server listens on (0: a free port).")
    tensor_parallel_size: int = Field(1, gt=0, description="`--tensor-parallel-size` (GPUs per server).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="`--dtype` (None: model.dtype).")
    max_model_len: int | None = Field(None, gt=0, description="`--max-model-len` (None: model.max_context).")
    kv_cache_space_gb: float | None = Field(
        2.0, gt=0, description="CPU build: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE); None: vLLM's default.")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="`--gpu-memory-utilization` (CUDA).")
    enforce_eager: bool = Field(True, description="`--enforce-eager`: no torch.compile/CUDA graphs (starts in ~20 s "
                                                  "on CPU instead of ~130 s).")
    connector: Literal["auto", "cpu", "stock"] = Field(
        "auto", description="04: the hidden-states connector: `cpu` (the project's, for vLLM's CPU build), `stock` "
                            "(vLLM's ExampleHiddenStatesConnector, CUDA); auto: cpu when model.device is cpu.")
    start_timeout_s: float = Field(900.0, gt=0, description="Longest wait for the server's /health after starting it.")
    extra_args: list[str] = Field(default_factory=list, description="More `api_server` flags, as given.")


class VLLMParams(Strict):
    base_url: str | None = Field(
        None, description="vLLM OpenAI-compatible server URL with its /v1, e.g. http://127.0.0.1:8000/v1 (None with "
                          "`launch`: the started server's).")
    launch: bool = Field(False, description="Start a vLLM server on this machine for the run (`server`), stop it after.")
    server: VLLMServerParams = Field(default_factory=VLLMServerParams, description="The server `launch` starts.")
    model: str | None = Field(
        None, description="Served model name sent as `model` (None = the one model GET /v1/models lists)."
    )
    batch_size: int = Field(1, gt=0, le=256, description="Prompts per /completions request (a list of id lists).")
    check_model: bool = Field(True, description="Refuse to start if /v1/models names another model.")

    @model_validator(mode="after")
    def _url_or_launch(self) -> "VLLMParams":
        if self.base_url is None and not self.launch:
            raise ValueError("a vLLM server needs `base_url` (a running one) or `launch: true` (one started here)")
        return self


class ProviderRouting(Strict):
    order: list[str] | None = Field(None, description="Providers to try in order.")
    only: list[str] | None = Field(None, description="Allow only these providers.")
    ignore: list[str] | None = Field(None, description="Never route to these providers.")
    quantizations: list[str] | None = Field(None, description="Allowed quantizations, e.g. [int4, fp8].")
    allow_fallbacks: bool | None = Field(None, description="Let OpenRouter fall back beyond `order`.")
    sort: Literal["price", "throughput", "latency"] | None = Field(None, description="Provider sort key.")
    data_collection: Literal["allow", "deny"] | None = Field(None, description="Provider data-retention policy.")
    require_parameters: bool | None = Field(None, description="Only providers that honour every parameter.")
    max_price: dict[str, float] | None = Field(
        None, description="Most USD per million tokens a provider may charge, e.g. {prompt: 1, completion: 3}."
    )


class ReasoningParams(Strict):
    effort: Literal["minimal", "low", "medium", "high"] | None = Field(None, description="Reasoning effort.")
    max_tokens: int | None = Field(None, gt=0, description="Reasoning token cap (instead of effort).")
    exclude: bool = Field(False, description="True drops reasoning from the response: never for drafter data.")
    enabled: bool | None = Field(None, description="Turn reasoning on/off explicitly.")


class OpenAIParams(Strict):
    base_url: str = Field(description="OpenAI-compatible base URL, e.g. https://openrouter.ai/api/v1.")
    api_key_env: str = Field("OPENROUTER_API_KEY", description="Environment variable holding the key (never the key).")
    model: str = Field(description="Model id at the API, e.g. moonshotai/kimi-k2.5.")
    provider: ProviderRouting | None = Field(None, description="OpenRouter provider routing.")
    reasoning: ReasoningParams | None = Field(None, description="OpenRouter reasoning settings.")
    check_credit: bool = Field(True, description="Read GET {base_url}/key before starting (OpenRouter).")
    min_credit_usd: float = Field(0.0, ge=0.0, description="Refuse to start below this remaining credit.")
    credit_poll_s: float = Field(
        30.0, gt=0, description="Re-read GET {base_url}/key this often while running (credit in the progress line)."
    )
    logprobs: bool = Field(
        False, description="Ask for per-token log-probabilities (OpenAI `logprobs: true`): 02 then takes the content's "
                           "ids from the provider's own tokens (proof level `token`). Sets OpenRouter's "
                           "`provider.require_parameters: true` so only providers that return them are used.",
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="Alternatives per position with `logprobs` (OpenAI `top_logprobs`, 0-20; None: "
                                       "not sent). 02 needs none; they only make records larger.",
    )
    history_reasoning: Literal["reasoning", "reasoning_content", "reasoning_details", "none"] | None = Field(
        None, description="turns: all: the field an earlier reply's reasoning goes back in (assistant messages of the "
                          "history): `reasoning_details` (OpenRouter's preserved reasoning blocks, one `reasoning.text` "
                          "block), `reasoning` (OpenRouter's plain-text field), `reasoning_content` (Moonshot's API, "
                          "vLLM/SGLang chat templates), `none` (not sent). None: from base_url's host (openrouter.ai: "
                          "reasoning_details; else reasoning_content). docs/01 Turns.",
    )

    @model_validator(mode="after")
    def _logprobs_routing(self) -> "OpenAIParams":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("generate.openai.top_logprobs needs generate.openai.logprobs: true")
        if self.logprobs and self.provider is not None and self.provider.require_parameters is False:
            raise ValueError("generate.openai.logprobs needs provider.require_parameters true (a provider that "
                             "ignores `logprobs` would answer without them); leave it unset or set it true")
        return self


class GenerateParams(Strict):
    backend: Literal["local", "sglang", "vllm", "openai"] = Field("local", description="Where responses come from.")
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Sampling settings.")
    batch_size: int = Field(8, gt=0, description="Local backend: rows decoding together (continuous batching: a finished row's slot takes the next prompt).")
    sglang: SGLangParams | None = Field(None, description="Settings for backend `sglang`.")
    vllm: VLLMParams | None = Field(None, description="Settings for backend `vllm`.")
    openai: OpenAIParams | None = Field(None, description="Settings for backend `openai`.")
    concurrency: int = Field(64, gt=0, le=10000, description="HTTP backends: requests in flight at most.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(5, ge=0, description="Retries on 408/5xx/connection errors before an error record.")
    cost_cap_usd: float | None = Field(None, gt=0, description="Stop dispatching when spent + reserved reaches it.")
    resume: bool = Field(True, description="Skip (dataset, sample_id) pairs already in the journal.")
    retry_errors: bool = Field(False, description="On resume, send again samples whose record is an error.")
    stop_grace_s: float = Field(60.0, ge=0, description="On stop, wait this long for requests in flight.")
    budget_counts: Literal["total", "completion"] = Field(
        "total", description="What a dataset's token_budget counts: prompt+completion tokens, or completion only."
    )
    reserve_completion_tokens: int | None = Field(
        None, gt=0,
        description="Completion tokens reserved per request in flight against the budget (None = max_new_tokens).",
    )
    retry_backoff_s: float = Field(1.0, gt=0, description="First retry delay; doubles per retry, jittered x0.5-1.5.")
    retry_backoff_max_s: float = Field(60.0, gt=0, description="Longest delay between two retries.")
    max_rate_limit_retries: int = Field(50, ge=0, description="Retries after HTTP 429 (each waits Retry-After).")
    journal_fsync: bool = Field(False, description="fsync every journal line (survives power loss; slower).")
    http2: bool = Field(True, description="HTTP backends over https: HTTP/2 where the server offers it (ALPN), many "
                        "requests per connection; false: HTTP/1.1 keep-alive, one connection per request in flight "
                        "(for a proxy that mishandles HTTP/2).")
    ledger_interval_s: float = Field(1.0, gt=0, description="How often ledger.json and the progress line refresh.")
    turns: Literal["last", "all"] = Field(
        "last", description="`last`: regenerate the last assistant turn only (the history is the dataset's); "
        "`all`: regenerate every assistant turn in order, each from the model's own earlier replies (one record per turn, "
        "dataset tool results spliced in where the model's call matches).")
    max_turns: int | None = Field(None, gt=0, description="turns: all: generate at most this many turns per conversation.")

    @model_validator(mode="after")
    def _backend_settings_present(self) -> "GenerateParams":
        if self.backend == "sglang" and self.sglang is None:
            raise ValueError("backend 'sglang' needs a `generate.sglang` section (base_url, or launch: true)")
        if self.backend == "vllm" and self.vllm is None:
            raise ValueError("backend 'vllm' needs a `generate.vllm` section (base_url, or launch: true)")
        if self.backend == "openai" and self.openai is None:
            raise ValueError("backend 'openai' needs a `generate.openai` section (base_url, model)")
        return self
