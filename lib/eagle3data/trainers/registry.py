"""The one table of trainers, by name: what params, 04's store, the hand-off and the export ask."""

from __future__ import annotations

from eagle3data.trainers.base import HandoffError, Trainer
from eagle3data.trainers.specforge import SpecForge
from eagle3data.trainers.speculators import Speculators

TRAINERS: dict[str, Trainer] = {t.name: t for t in (SpecForge(), Speculators())}


def get_trainer(name: str) -> Trainer:
    """The trainer called `name` (a `hidden.layout` other than `shards`, an `export.formats` entry)."""
    try:
        return TRAINERS[name]
    except KeyError:
        raise HandoffError(f"unknown trainer {name!r}; trainers: {', '.join(TRAINERS)}") from None


def trainer_for_suffix(suffix: str) -> Trainer | None:
    """The trainer whose per-sample files end in `suffix` (the first registered), or None."""
    return next((t for t in TRAINERS.values() if t.sample_suffix == suffix), None)
