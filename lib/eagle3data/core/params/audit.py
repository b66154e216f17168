"""03's params (`audit:`): the record the inspector opens, the roundtrip, which checks only flag, failing examples shown,
the chunk of records held at a time."""

from __future__ import annotations

from pydantic import Field

from eagle3data.core.params.base import Strict


class AuditParams(Strict):
    inspect_dataset: str | None = Field("b1_glaive", description="Dataset of the record the inspector opens.")
    inspect_sample_id: int | str | None = Field(1601, description="sample_id the inspector opens.")
    roundtrip: bool = Field(True, description="Run decode->encode roundtrip on every record.")
    flag_only: list[str] = Field(
        ["text.roundtrip"],
        description="Checks whose failure flags a record (counted, bounded, shown with examples; the record stays in "
                    "the mix) instead of failing it (out of the mix). text.roundtrip by default: a model's "
                    "non-canonical split (encode(decode(ids)) != ids) is what it really produced and what re-tokenizing "
                    "its text would lose (reference.md section 5); gating on it drops those records and biases the "
                    "mix toward canonical text (a T = 1 run lost 65% of its records). [] gates every check.")
    failing_examples: int = Field(3, ge=0, description="Failing records shown per failed check in the report.")
    chunk_records: int = Field(
        512, ge=1,
        description="Journal lines read, checked and let go at a time: bounds 03's memory (ids, texts and the "
                    "tokenizer's batches of one chunk; every record keeps only its small facts: statuses, "
                    "positions, lengths, hashes), whatever the run's size. Larger chunks feed the tokenizer's "
                    "parallel batches better; verdicts do not depend on it.")
