"""The whole-model step's materiality rule and shortlist (kvcalib.calibration.output.close_call), from the attention
objective's scored candidates built by hand, and the record a choice is written as (kvcalib.core.choice)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcalib.calibration import objective
from kvcalib.calibration.output import close_call
from kvcalib.core.choice import ScaleChoice
from kvcalib.core.records import to_json

# absmax, a clip (half absmax's range), 1.0 and a wider scale: the last two keep absmax's range
SCALES = (1.0, 0.5, 2.0, 4.0)


def _scored(errors: list[float], held: list[float]) -> objective.Scored:
    scale = torch.tensor(SCALES)[:, None]
    cands = objective.Candidates(("absmax", "a", "1.0", "b"), scale, scale, scale)
    terms = torch.stack([torch.tensor(errors), torch.tensor(held), torch.zeros(4), torch.ones(4)])
    return objective.choose(terms[:, :, None].double(), torch.ones(2, 1), cands, per_head=False)


@pytest.mark.parametrize(
    ("errors", "held", "pick", "expected"),
    [
        # the clip halves absmax's error: it is picked, and a clip on the table makes a close call; the shortlist is
        # the pick, the two lowest errors (the pick again, 1.0) and absmax
        ([1.0, 0.2, 0.9, 0.95], [1.0, 0.2, 0.9, 0.95], (1,), (((1,), (2,), (0,)), True)),
        # every candidate alike: absmax, and nothing to weigh
        ([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], (0,), None),
        # 1.0 beats absmax by more than a tenth on the choosing rows but not on the held-out ones: absmax is
        # picked, and the gap makes a close call without a clip on the table
        ([1.0, 2.0, 0.7, 2.0], [1.0, 2.0, 0.95, 2.0], (0,), (((0,), (2,)), False)),
    ],
)
def test_a_close_call_is_a_clip_on_the_table_or_a_gap(errors, held, pick, expected):
    scored = _scored(errors, held)
    assert scored.index == pick
    assert close_call(scored) == expected


def test_a_choice_record_reads_as_its_json():
    """Fields left None are not recorded; the pairs are JSON objects."""
    choice = ScaleChoice(
        "absmax x0.5", clipped=0.01, attention_error_on=(("trn2", 0.1),), step="output"
    )
    assert to_json(choice) == {
        "label": "absmax x0.5",
        "clipped": 0.01,
        "attention_error_on": {"trn2": 0.1},
        "step": "output",
    }
    assert to_json(choice) == json.loads(json.dumps(to_json(choice)))
