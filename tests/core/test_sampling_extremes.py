"""Extreme sampling values: refused past the bounds, sampled sanely at them.

In float32 a temperature of 3.5e38 is infinite and turns a banned token's -inf into NaN,
and a repetition penalty of 1e-39 makes a seen token's logit infinite; either way every
draw used to be token 0.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagedllm.core.request import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    Request,
    SamplingParams,
)
from pagedllm.core.sampler import Sampler

EOS = 0  # token 0 is what the broken arithmetic always produced: make it the banned one
ROWS = 400


def draw(params: SamplingParams, logits: list[float], seen: tuple[int, ...] = ()) -> Counter:
    """Token counts of ROWS draws of one logits row; `seen` tokens are in each request's output."""
    requests = []
    for i in range(ROWS):
        req = Request(str(i), [3], params, eos_token_ids=(EOS,))
        for token in seen:
            req.append_token(token)
        requests.append(req)
    out = Sampler(0, torch.device("cpu"))(torch.tensor([logits] * ROWS), requests)
    return Counter(out.token_ids)


@pytest.mark.parametrize("field,value", [
    ("temperature", 3.5e38), ("temperature", 1e300), ("temperature", math.inf), ("temperature", math.nan),
    ("temperature", MAX_TEMPERATURE * 1.01),
    ("repetition_penalty", 1e-39), ("repetition_penalty", MIN_REPETITION_PENALTY / 1.01),
    ("repetition_penalty", MAX_REPETITION_PENALTY * 1.01), ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
])
def test_values_past_the_bounds_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be in"):
        SamplingParams(**{field: value}, min_tokens=2)


def test_largest_temperature_samples_uniformly_and_keeps_the_ban() -> None:
    counts = draw(SamplingParams(temperature=MAX_TEMPERATURE, min_tokens=2), [5.0, -1.0, 0.5, 3.0, 2.0])
    assert EOS not in counts, "EOS is banned until min_tokens"
    assert set(counts) == {1, 2, 3, 4} and min(counts.values()) > ROWS / 4 * 0.6, counts


def test_smallest_repetition_penalty_favours_the_seen_token() -> None:
    params = SamplingParams(temperature=1.0, repetition_penalty=MIN_REPETITION_PENALTY, min_tokens=5)
    assert draw(params, [4.0, 1.0, 2.0, 1.5, 1.0], seen=(2,)) == Counter({2: ROWS})


def test_largest_repetition_penalty_avoids_the_seen_tokens() -> None:
    params = SamplingParams(temperature=1.0, repetition_penalty=MAX_REPETITION_PENALTY, min_tokens=5)
    counts = draw(params, [4.0, 1.0, 2.0, -1.5, 1.0], seen=(2, 3))
    assert EOS not in counts and set(counts) <= {1, 2, 4} and counts[2] < ROWS / 4, counts
