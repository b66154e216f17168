"""06's params (`value:`): train a draft on the run's speculators hand-off and measure its acceptance length.

Every variant trains with the same `train` settings (budget, seed, draft config) and is judged on the
same evaluation prompts (`eval`); docs/06 says what each figure means."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from eagle3data.core.params.base import Strict
from eagle3data.core.params.generate import VLLMServerParams


class ValueTrainParams(Strict):
    epochs: int = Field(1, gt=0, description="Passes over the training rows.")
    total_seq_len: int = Field(1024, gt=0, description="Tokens per packed step (speculators' multipack: samples "
                                                       "packed up to this length, one document mask).")
    lr: float = Field(1e-3, gt=0, description="Learning rate (speculators' default).")
    optimizer: Literal["muon", "adamw"] = Field("muon", description="speculators' build_optimizers: Muon on matrices "
                                                                    "+ AdamW on the rest (its default), or AdamW.")
    ttt_steps: int = Field(3, gt=0, le=8, description="Test-time-training steps (speculators' default 3).")
    loss_fn: str = Field("kl_div", description="speculators' loss name (its default for EAGLE-3: kl_div).")
    num_layers: int = Field(1, gt=0, description="Draft decoder layers (EAGLE-3: 1).")
    seed: int = Field(0, description="Seeds the draft's init and the packing order.")
    seeds: list[int] | None = Field(None, min_length=1, description="Train exact once per seed (distinct, `seed` "
                                                                    "among them: its draft is the one every variant "
                                                                    "is compared with) for τ's spread over training "
                                                                    "seeds (None: [seed]; other variants: `seed`).")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps (None: all epochs).")
    max_train_samples: int | None = Field(None, gt=0, description="Train on the first N rows of the hand-off only.")
    checkpoint_every: int = Field(50, gt=0, description="Steps between checkpoints (also written on Ctrl-C).")
    threads: int | None = Field(None, gt=0, description="torch threads (None: torch's default).")
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="Muon's orthogonalization: bfloat16 is torch's own; auto keeps it on a GPU or a CPU with "
        "native bf16 matmul (AVX512-BF16, AMX) and runs the same iteration in float32 on one without (AVX2: ~30x "
        "faster there; value/muon_cpu.py).")

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"seeds {v} repeat a seed (a repeated seed trains the same draft: no spread)")
        return v

    @model_validator(mode="after")
    def _seed_among_seeds(self) -> "ValueTrainParams":
        if self.seeds is not None and self.seed not in self.seeds:
            raise ValueError(f"seeds {self.seeds} leave out seed {self.seed} (exact's own draft, every variant's "
                             "reference): add it, or set seed to one of them")
        return self


class ValueEvalParams(Strict):
    humaneval: int | None = Field(164, ge=0, description="HumanEval problems to evaluate on (0: none; 164: all).")
    held_out_per_dataset: int = Field(32, ge=0, description="Conversations of each run dataset held out of training "
                                                            "and evaluated on (picked by a seeded hash of the key).")
    seed: int = Field(0, description="Seeds the held-out pick.")
    max_new_tokens: int = Field(128, gt=0, description="Greedy tokens per evaluation prompt.")
    num_speculative_tokens: int = Field(3, gt=0, le=8, description="K: drafts per verification step (vLLM) and the "
                                                                   "depth of the offline chain.")
    concurrency: int = Field(8, gt=0, description="Evaluation requests in flight.")
    engine: bool = Field(True, description="Measure τ through vLLM's speculative decoding (needs `make engine`).")
    temperatures: list[Annotated[float, Field(ge=0)]] = Field(
        default_factory=lambda: [0.0], min_length=1,
        description="Sampling temperatures τ is measured at (0: greedy), offline (T > 0: speculative sampling's "
                    "acceptance of the draft's greedy tokens, as vLLM drafts) and through the engine (its rejection "
                    "sampler, each request seeded; ids equal greedy's is checked at T = 0).")
    engine_variants: list[str] | None = Field(
        None, description="Variants measured through the engine as well as offline (None: every variant; exact's "
                          "other seeds follow exact). The rest are measured offline only: the engine's decoding is "
                          "most of a variant's time; the two figures' agreement is shown where both ran.")
    server: VLLMServerParams = Field(default_factory=lambda: VLLMServerParams(port=0),
                                     description="The vLLM servers 06 starts (plain and speculative).")

    @field_validator("temperatures")
    @classmethod
    def _distinct_temperatures(cls, v: list[float]) -> list[float]:
        if len(set(v)) != len(v):
            raise ValueError(f"temperatures {v} repeat a temperature")
        return v


class ValueParams(Strict):
    enabled: bool = Field(False, description="`eagle3data run` runs stage 06 after 05.")
    variants: list[str] = Field(default_factory=lambda: ["exact"], min_length=1,
                                description="Drafts to train and compare (`exact`: the run's hand-off as it is).")
    sampled_temperature: float = Field(1.0, gt=0, le=2, description="Temperature the `sampled` variant regenerates "
                                                                     "the training prompts at (seeded by "
                                                                     "generate.sampling.seed).")
    train: ValueTrainParams = Field(default_factory=ValueTrainParams)
    eval: ValueEvalParams = Field(default_factory=ValueEvalParams)
