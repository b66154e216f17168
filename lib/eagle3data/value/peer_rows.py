"""What a peer trainer's own text path makes of the run's conversations: one training row per sample (issue 60).

06's `text_rule` and `template_other` variants price the peers' text paths in τ: a trainer that takes
conversations as text and tokenizes them itself. Each path turns the run's samples (the mix's rows with their
records) into `PeerRow`s: the ids and loss mask that trainer would train on, and how its ids compare with ours.

- `text_rule` (value/text_rule.py): TorchSpec's and Model-Optimizer's rule: the target's own chat template
  rendered as text, encoded without special tokens, their assistant loss mask.
- `template_other` (value/template_other.py): SpecForge 0.2.0's `data.train_data_path` path: the conversation
  rendered by its own template registry (`qwen`, ChatML: no SmolLM2 template there), ids and mask from its
  `preprocess_conversations`.

The variant's run folder then holds these rows as 02's lines would (value/variants.py), 04 computes the states
for those ids, and 05 hands them to speculators as for every other variant.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3data.core.reader import SampleKey

# how a peer row's ids compare with the sample's exact ids (export/text_drift.py's kinds)
KINDS = ("equal", "equal_then_template_tail", "end_of_turn_added", "inside")


@dataclass
class PeerRow:
    """One sample as the peer's text path makes it."""

    key: SampleKey
    input_ids: list[int]
    loss_mask: list[int]  # 0/1, one per input id: what the peer's trainer supervises
    kind: str  # one of KINDS: the ids against the sample's exact ids

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"{self.key}: {len(self.loss_mask)} loss_mask entries for {len(self.input_ids)} input_ids")
        if self.kind not in KINDS:
            raise ValueError(f"{self.key}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
