"""05's params (`export:`): the draft vocabulary, the trainers the mix is handed to, unverified stores."""

from __future__ import annotations

from pydantic import Field, field_validator

from eagle3data.core.params.base import Strict
from eagle3data.trainers.registry import TRAINERS

# Hand-offs to trainers that compute the states while they train (`export/online.py`): the mix's ids and masks only,
# no hidden states, so they need no 04 store.
ONLINE_FORMATS: tuple[str, ...] = ("speculators_online", "specforge_online")


def trainer_names() -> list[str]:
    """The registered trainers (`trainers.registry`), in their order: the formats an export hands the mix to."""
    return list(TRAINERS)


def format_names() -> list[str]:
    """Every export format: the registered trainers' offline hand-offs, then the online ones."""
    return [*trainer_names(), *ONLINE_FORMATS]


class ExportParams(Strict):
    draft_vocab_size: int = Field(32000, gt=0, description="Size of the EAGLE-3 draft vocabulary (d2t/t2d).")
    allow_unverified: bool = Field(False, description="Export hidden states that verify-hidden has not passed "
                                                      "(unverified or failing store); the manifest says so.")
    formats: list[str] = Field(
        default_factory=trainer_names, min_length=1,
        description="Trainers to hand the mix to. A trainer whose layout is hidden.layout is hardlinked (no copy); "
                    "any other is a full converted copy of the hidden states (04's estimate says how much). "
                    "`speculators_online` / `specforge_online`: ids and masks only, the states computed by a "
                    "serving engine while the trainer trains (no 04 store needed).")
    online_max_length: int | None = Field(
        None, gt=0, description="Online hand-offs: the sequence length the trainers are configured with (speculators "
                                "prepare-data `--seq-length`, SpecForge `data.max_length`). None: the longest row, "
                                "nothing cut. Rows it would truncate or leave with nothing supervised are reported "
                                "before training (manifest `window`).")

    chunk_rows: int = Field(
        256, gt=0, description="Rows 05 reads from the mix and writes at a time (every hand-off, the vocabulary's "
                               "counts, the text trainers' count): what bounds its memory, not the run's size.")

    @field_validator("formats")
    @classmethod
    def _known_trainers(cls, v: list[str]) -> list[str]:
        bad = [f for f in v if f not in format_names()]
        if bad:
            raise ValueError(f"unknown trainer {bad[0]!r}; known: {', '.join(format_names())}")
        return v
