"""03's params (`audit:`): the record the inspector opens, the roundtrip, failing examples shown."""

from __future__ import annotations

from pydantic import Field

from eagle3data.core.params.base import Strict


class AuditParams(Strict):
    inspect_dataset: str | None = Field("b1_glaive", description="Dataset of the record the inspector opens.")
    inspect_sample_id: int | str | None = Field(1601, description="sample_id the inspector opens.")
    roundtrip: bool = Field(True, description="Run decode->encode roundtrip on every record.")
    failing_examples: int = Field(3, ge=0, description="Failing records shown per failed check in the report.")
