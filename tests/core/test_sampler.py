"""Sampler: each processor on hand-made logits, seeded determinism, logprobs."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.request import Request, SamplingParams
from pagedllm.core.sampler import Sampler, _top_k_top_p


def reqs(*params, outputs=()):
    out = []
    for i, p in enumerate(params):
        r = Request(str(i), [3], p, eos_token_id=0)
        for t in outputs:
            r.append_token(t)
        out.append(r)
    return out


def test_greedy_picks_argmax_and_reports_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = Sampler(0, torch.device("cpu"))(logits, reqs(SamplingParams(temperature=0, logprobs=2)))
    assert out.token_ids == [1]
    chosen, rank, ids, vals = out.logprobs[0]
    assert rank == 1 and ids == [1, 3]
    assert chosen == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked = _top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]
    masked = _top_k_top_p(logits, torch.tensor([1]), torch.tensor([1.0]))
    assert torch.isfinite(masked).tolist() == [[True, False, False, False]]


def test_min_p_and_min_tokens():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[5.0, 4.9, -5.0, -5.0]] * 50)
    params = SamplingParams(temperature=1.0, min_p=0.5, min_tokens=3)
    tokens = sampler(logits, reqs(*[params] * 50)).token_ids
    assert set(tokens) == {1}, "EOS (id 0) must be banned before min_tokens; min_p drops ids 2, 3"


def test_penalties():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    rep = sampler(logits, reqs(SamplingParams(temperature=0, repetition_penalty=2.0), outputs=[1])).token_ids
    assert rep == [2]
    freq = sampler(logits, reqs(SamplingParams(temperature=0, frequency_penalty=0.2), outputs=[1])).token_ids
    assert freq == [2]
    pres = sampler(logits, reqs(SamplingParams(temperature=0, presence_penalty=0.05), outputs=[1])).token_ids
    assert pres == [1]


def test_sampling_follows_the_distribution():
    sampler = Sampler(0, torch.device("cpu"))
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).repeat(4000, 1)
    tokens = torch.tensor(sampler(logits, reqs(*[SamplingParams(temperature=1.0)] * 4000)).token_ids)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_neighbours():
    logits = torch.randn(3, 50)
    seeded = SamplingParams(temperature=1.0, seed=42)
    a = Sampler(0, torch.device("cpu"))(logits[:1], reqs(seeded)).token_ids[0]
    batch = reqs(SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.5))
    batch[1].request_id = "0"
    b = Sampler(1, torch.device("cpu"))(torch.stack([logits[1], logits[0], logits[2]]), batch).token_ids[1]
    assert a == b
