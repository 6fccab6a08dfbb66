"""Sampler: each processor on hand-made logits, seeded determinism, logprobs."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.request import Request, SamplingParams
from pagedllm.core.sampler import CANDIDATES, CHUNK, Sampler, _candidates, _inverse_cdf


def reqs(*params, outputs=()):
    out = []
    for i, p in enumerate(params):
        r = Request(str(i), [3], p, eos_token_ids=(0,))
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


def kept(logits, top_k, top_p):
    """The token ids `_candidates` keeps in each row, as sets."""
    vals, ids = _candidates(logits, torch.tensor(top_k), torch.tensor(top_p))
    return [set(i[torch.isfinite(v)].tolist()) for v, i in zip(vals, ids)]


def reference_kept(row, k, p):
    """top-k then top-p by a full sort, written out plainly."""
    order = row.argsort(descending=True).tolist()
    if k > 0:
        order = order[:k]
    probs = torch.softmax(row[order].double(), -1).tolist()
    out, mass = set(), 0.0
    for token, prob in zip(order, probs):
        if out and mass >= p:
            break
        out.add(token)
        mass += prob
    return out


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert kept(logits, [0], [0.7]) == [{0, 1}]
    assert kept(logits, [1], [1.0]) == [{0}]
    assert kept(logits, [3], [0.6]) == [{0, 1}], "top-p renormalizes over the top-k"


def test_nucleus_wider_than_the_first_candidates_matches_a_full_sort():
    torch.manual_seed(0)
    vocab = 20 * CANDIDATES + 7
    logits = torch.stack([torch.randn(vocab) * 0.01, torch.randn(vocab) * 4, torch.randn(vocab)])
    top_k, top_p = [0, 0, 300], [0.9, 0.95, 0.5]
    got = kept(logits, top_k, top_p)
    for row, k, p, have in zip(logits, top_k, top_p, got):
        assert have == reference_kept(row, k, p)
    assert len(got[0]) > 8 * CANDIDATES, "a flat row's nucleus spans most of the vocabulary"


def test_inverse_cdf_draws_follow_the_distribution_and_skip_zero_mass():
    vocab = 3 * CHUNK + 5  # spans slices, with a padded last one
    probs = torch.zeros(vocab)
    probs[[0, CHUNK - 1, CHUNK, 2 * CHUNK + 3, vocab - 1]] = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    draws = 20000
    u = torch.rand(draws, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    picked = _inverse_cdf((probs * 7).repeat(draws, 1), u)  # unnormalized on purpose
    counts = torch.bincount(picked, minlength=vocab)
    assert set(picked.tolist()) <= {0, CHUNK - 1, CHUNK, 2 * CHUNK + 3, vocab - 1}
    assert torch.allclose(counts.double() / draws, probs.double(), atol=0.015)
    edges = _inverse_cdf(probs.repeat(2, 1), torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64))
    assert edges.tolist() == [0, vocab - 1], "u at either end still lands on a token with mass"


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
