"""02's params (`reconstruct:`): the count tolerance and calibration of billed tokens, drift, seam proofs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from eagle3data.core.params.base import Strict


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
    batch_size: int = Field(
        1024, gt=0, description="Records per batched tokenizer call, and the chunk 02 holds in memory: 02 streams, "
                                "so this, not the run's size, bounds its memory (about 0.55 GiB plus 0.3 GiB per "
                                "1,000 records of ~2,400 tokens; the same time per token from 512 to 4096).",
    )
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
