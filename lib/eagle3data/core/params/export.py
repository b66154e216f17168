"""05's params (`export:`): the draft vocabulary, the trainers the mix is handed to, unverified stores."""

from __future__ import annotations

from pydantic import Field, field_validator

from eagle3data.core.params.base import Strict
from eagle3data.trainers.registry import TRAINERS


def trainer_names() -> list[str]:
    """The registered trainers (`trainers.registry`), in their order: the formats an export hands the mix to."""
    return list(TRAINERS)


class ExportParams(Strict):
    draft_vocab_size: int = Field(32000, gt=0, description="Size of the EAGLE-3 draft vocabulary (d2t/t2d).")
    allow_unverified: bool = Field(False, description="Export hidden states that verify-hidden has not passed "
                                                      "(unverified or failing store); the manifest says so.")
    formats: list[str] = Field(
        default_factory=trainer_names, min_length=1,
        description="Trainers to hand the mix to. A trainer whose layout is hidden.layout is hardlinked (no copy); "
                    "any other is a full converted copy of the hidden states (04's estimate says how much).")

    @field_validator("formats")
    @classmethod
    def _known_trainers(cls, v: list[str]) -> list[str]:
        bad = [f for f in v if f not in trainer_names()]
        if bad:
            raise ValueError(f"unknown trainer {bad[0]!r}; known: {', '.join(trainer_names())}")
        return v
