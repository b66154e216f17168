"""04's params (`hidden:`): the training mix, the capture backend, storage and layout, and 04's own
verification, with the rules that refuse what 04 or its verification cannot do."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from eagle3data.core.params.base import Strict
from eagle3data.core.params.export import trainer_names
from eagle3data.core.params.generate import SGLangParams, VLLMParams
from eagle3data.core.quant import StateCodec, storage_problem
from eagle3data.trainers.registry import get_trainer


# Head positions of 04's verification (docs/04 "Head positions"): per sample at least Z_OUT_FLOOR output and
# Z_PROMPT_FLOOR prompt positions are scored by the logit z (`hidden/verify/checks.head_counts`). A cap on the
# positions per sample (`--positions`, `hidden.verify_positions`) is 0 (every position) or at least the floors: the z
# limits were measured at 64 positions; at 32 prompt positions the embedded store's worst clean sample failed 741 of
# 20,000 draws, so a lower cap fails clean samples.
Z_OUT_FLOOR = 64
Z_PROMPT_FLOOR = 64
MIN_POSITIONS = max(Z_OUT_FLOOR, Z_PROMPT_FLOOR)

# The storage 04 uses when `hidden.storage` is not given, per layout: 06's written rule applied to its measured
# ablation (docs/04 "When to choose", docs/06 "Figures": int8/channel_rms +0.0001 τ, -0.0005 to +0.0006, and
# fp8_e4m3/token +0.0006, -0.0002 to +0.0014, against a limit of -0.0124; `storage_decision` in 06's summary).
# A trainer layout holds only what its trainer reads natively: speculators' FP8 files (one scale per token),
# SpecForge's bf16. Other layouts (a trainer registered later) keep bf16 until 06 measures them.
DEFAULT_STORAGE: dict[str, tuple[str, str]] = {
    "shards": ("int8", "channel_rms"),
    "speculators": ("fp8_e4m3", "token"),
    "specforge": ("bf16", "channel_rms"),
}


def default_storage(layout: str) -> tuple[str, str]:
    """(storage, storage_scale) 04 uses for `layout` when the params name neither."""
    return DEFAULT_STORAGE.get(layout, ("bf16", "channel_rms"))


def positions_problem(cap: int) -> str | None:
    """Why `cap` cannot be the most head positions per sample, or None: 0 (every position) or at least MIN_POSITIONS."""
    if cap == 0 or cap >= MIN_POSITIONS:
        return None
    return (f"must be 0 (every position) or at least {MIN_POSITIONS} (the floors the logit-z limits were measured "
            f"at: fewer positions fail clean samples)")


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


class HiddenSGLangParams(SGLangParams):
    """04 through SGLang: two passes, the aux states then the final one, radix cache off (docs/04 Which backend)."""

    final_url: str | None = Field(
        None, description="The final pass's server (`--enable-return-hidden-states`) when not launched; `base_url` is "
                          "the aux pass's (`--enable-return-aux-hidden-states`).")
    batch_size: int = Field(1, gt=0, le=1, description="One sample per request.")
    concurrency: int = Field(16, gt=0, le=10000, description="Requests in flight at most.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(3, ge=0, description="Retries on 408/5xx/connection errors before the sample fails.")

    @model_validator(mode="after")
    def _two_servers(self) -> "HiddenSGLangParams":
        if not self.launch and self.final_url is None:
            raise ValueError("04 through SGLang takes two servers: `base_url` (aux pass) and `final_url` (final pass), "
                             "or `launch: true`")
        return self


class HiddenParams(Strict):
    enabled: bool = Field(True, description="Run 04_extract_hidden.")
    backend: Literal["hf", "vllm", "sglang"] = Field(
        "hf", description="Who computes the states: `hf` (a transformers forward with hooks, torchrun ranks), "
                          "`vllm` (a vLLM server's extract_hidden_states: the engine for targets HF cannot run; one "
                          "pass) or `sglang` (SGLang's returned hidden states: two passes, post-norm final state only).")
    vllm: HiddenVLLMParams | None = Field(None, description="Settings for backend `vllm` (base_url, or launch: true).")
    sglang: HiddenSGLangParams | None = Field(
        None, description="Settings for backend `sglang` (base_url and final_url, or launch: true).")
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
    mix_chunk_rows: int = Field(
        256, gt=0, description="Records the training mix reads, resolves and writes at a time: its memory is this "
                               "many samples' ids plus a few small facts per record (key, length, content hash), "
                               "whatever the run's size.")
    probe_batches: int = Field(2, ge=0, description="Batches timed before the run for the time estimate (0 = none).")
    disk_margin: float = Field(
        1.05, ge=1.0, description="Refuse to start unless free disk >= this x the estimated bytes still to write."
    )
    allow_failed_samples: int = Field(
        0, ge=0, description="Samples the capture may fail (after their retries) and 04 still merge: they leave the "
                             "mix as `capture_failed`, named with their errors in index.json and the mix manifest, "
                             "and 05 exports the rest. More failures than this: 04 fails (exit 1), nothing merged.")
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
        "int8",
        description="How the states are stored: `bf16` = as captured in `dtype` (no quantization), or 8 bits per "
                    "value with fp32 scales beside them (`storage_scale`); the reader dequantizes. Not given: the "
                    "layout's default, chosen by 06's measured acceptance length (int8 for shards, fp8_e4m3 for "
                    "speculators, bf16 for specforge; docs/04 When to choose). docs/04 gives each choice's measured "
                    "error on the target's own predictions.",
    )
    storage_scale: Literal["token", "token_state", "channel_token", "channel_rms"] = Field(
        "channel_rms",
        description="8-bit scales: one per token over all states (hs-connectors' FP8 files), one per token and state, "
                    "or each state's channels divided by their absmax (`channel_token`) or RMS (`channel_rms`, the "
                    "measured best: docs/04) over the shard, then one per token and state. Not given: `token` "
                    "for layout speculators (its FP8 files), otherwise channel_rms.",
    )
    final_storage: Literal["same", "bf16", "fp8_e4m3", "int8"] = Field(
        "same", description="The final state(s)' own storage (same = `storage`), e.g. bf16 final with 8-bit aux layers."
    )

    @model_validator(mode="before")
    @classmethod
    def _layout_default_storage(cls, data: object) -> object:
        """`storage` / `storage_scale` not given: the layout's measured default (DEFAULT_STORAGE)."""
        if not isinstance(data, dict) or ("storage" in data and "storage_scale" in data):
            return data
        layout = data.get("layout", "shards")
        storage, scale = default_storage(layout if isinstance(layout, str) else "shards")
        data = dict(data)
        data.setdefault("storage", storage)
        if "storage_scale" not in data:  # speculators reads fp8 with one scale per token; 8-bit otherwise: channel_rms
            data["storage_scale"] = "token" if layout == "speculators" and data["storage"] == "fp8_e4m3" \
                else "channel_rms"
        return data

    @model_validator(mode="after")
    def _backend_settings_present(self) -> "HiddenParams":
        if self.backend == "vllm" and self.vllm is None:
            raise ValueError("backend 'vllm' needs a `hidden.vllm` section (base_url, or launch: true)")
        if self.backend == "sglang" and self.sglang is None:
            raise ValueError("backend 'sglang' needs a `hidden.sglang` section (base_url and final_url, or launch: true)")
        if self.backend == "sglang" and self.final_state != "post_norm":
            raise ValueError(f"backend 'sglang' returns the final state after the norm only: final_state is "
                             f"{self.final_state!r} (set post_norm, or use backend vllm or hf for pre_norm)")
        return self

    @field_validator("verify_positions")
    @classmethod
    def _positions_keep_the_floors(cls, v: int, info: ValidationInfo) -> int:
        if info.data.get("verify_after", True) and (why := positions_problem(v)):  # unused when 04 verifies nothing
            raise ValueError(why)
        return v

    @field_validator("layout")
    @classmethod
    def _known_layout(cls, v: str) -> str:
        if v != "shards" and v not in trainer_names():
            raise ValueError(f"unknown layout {v!r}; known: shards, {', '.join(trainer_names())}")
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


def storage_default_text(default: dict[str, str | None]) -> str:
    """`shards int8, speculators not measured, ...`: a decision's default per layout, unmeasured ones said so."""
    return ", ".join(f"{k} {v or 'not measured'}" for k, v in default.items())
