"""The first answer token's boundary (SpecForge #885), read in each trainer's own alignment code (issue 60).

At inference the target's prefill produces the first answer token x_P itself; the draft's first proposal is the
token after it, made from the target's state at the last prompt position and x_P's embedding. A trainer that
wants the draft good at that first proposal must train the position whose input token is x_P. Our hand-off's
`loss_mask` is 1 on the output tokens x_P .. x_{L-1} (05's rows; speculators' prepare-data keeps a pre-tokenized
row's mask as it is, SpecForge's prompt builder too). What each trainer makes of it, by its own functions:

- speculators 0.9.0, `models/eagle3/data.py::shift_batch`: input token x_{i+1}, state g_i, target y_{i+1}, mask
  l_{i+1} at position i: the mask goes with the input token, so x_P's position is trained (its target the
  distribution after x_P), as is every later output token's.
- SpecForge 0.2.0, `modeling/target/target_head.py::TargetHead.preprocess` (`specforge.utils.padding`): input
  and target shift left, the mask does not: the position whose input is x_P has mask l_{P-1} = 0 (never
  trained, from our rows or from its own `data/parse.py` masks), and the last position trains on the zero
  padding (input 0, a zero target). SpecForge PR #895 (open) shifts the mask with them.

These tests pin both facts to the installed code: if either trainer changes its alignment they fail, and
docs/05 ("The first answer token") must be read again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from runfiles import make_record  # noqa: E402

from eagle3data.core.reader import resolve
from eagle3data.export.online import prompt_line

PROMPT = (1, 9, 4, 7, 6)  # x_0 .. x_4: P = 5
OUTPUT = (31, 32, 33, 34, 2)  # x_5 .. x_9: the answer, its end-of-turn last


def _row() -> dict:
    """A hand-off row as 05 writes it (SpecForge's prompts.jsonl line; speculators' rows hold the same ids and mask)."""
    row = prompt_line(resolve(make_record("d", 1, PROMPT, OUTPUT), {}))
    assert row["input_ids"] == [*PROMPT, *OUTPUT] and row["loss_mask"] == [0] * 5 + [1] * 5
    return row


def _positions(n: int) -> torch.Tensor:
    """Stand-in states whose value is their position, so a shift is read off the numbers."""
    return torch.arange(n, dtype=torch.float32)[:, None] + 100


def test_speculators_trains_the_position_whose_input_is_the_first_answer_token():
    from speculators.models.eagle3.data import shift_batch

    row = _row()
    ids, n = torch.tensor(row["input_ids"]), len(row["input_ids"])
    b = shift_batch({"input_ids": ids, "hidden_states": _positions(n), "verifier_last_hidden_states": _positions(n),
                     "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.bool), "lengths": torch.tensor([n]),
                     "position_ids": torch.arange(n)})
    trained = torch.nonzero(b["loss_mask"]).flatten().tolist()
    inputs = [int(b["input_ids"][i]) for i in trained]
    assert inputs == list(OUTPUT)  # x_P first: the draft learns the token after the first answer token
    # each trained position's state is the one before its input token, its target the state at the input token
    assert [int(b["hidden_states"][i]) - 100 for i in trained] == list(range(4, 9))
    assert [int(b["verifier_last_hidden_states"][i]) - 100 for i in trained] == list(range(5, 10))


def test_specforge_never_trains_the_position_whose_input_is_the_first_answer_token():
    from specforge.modeling.target.target_head import TargetHead

    row = _row()
    n = len(row["input_ids"])
    # `preprocess` uses nothing of the head (`self`): SpecForge's own alignment, called as its training step calls it
    ids, target, mask = TargetHead.preprocess(None, torch.tensor([row["input_ids"]]), _positions(n)[None],
                                              torch.tensor([row["loss_mask"]]))
    mask = mask[0, :, 0]
    trained = torch.nonzero(mask).flatten().tolist()
    inputs = [int(ids[0, i]) for i in trained]
    assert 31 not in inputs  # x_P is the input at position P-1, whose mask is the prompt's 0
    assert int(ids[0, 4]) == 31 and int(mask[4]) == 0
    assert inputs == [32, 33, 34, 2, 0]  # ... and the last trained position is the padding
    assert float(target[0, trained[-1], 0]) == 0.0  # its target: the zero pad, not a state of the row
    # the remedy PR #895 makes inside SpecForge: a mask shifted with the ids trains speculators' positions
    shifted = torch.tensor([row["loss_mask"][1:] + [0]])
    mask2 = TargetHead.preprocess(None, torch.tensor([row["input_ids"]]), _positions(n)[None], shifted)[2][0, :, 0]
    assert [int(ids[0, i]) for i in torch.nonzero(mask2).flatten().tolist()] == list(OUTPUT)
