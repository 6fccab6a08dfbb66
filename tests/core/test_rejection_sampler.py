"""The rejection sampler (`Sampler.verify`): greedy acceptance, and sampling that keeps
the target's distribution exactly, proven by a chi-square test that a deliberately
broken sampler fails."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.core import sampler as sampler_module
from pagedllm.core.request import Request, SamplingParams
from pagedllm.core.sampler import Sampler

VOCAB = 6
SAMPLES = 4000
# chi-square critical value at p = 0.001 for VOCAB - 1 = 5 degrees of freedom
CHI2_CRITICAL = 20.52


def req(rid="r", **params) -> Request:
    return Request(rid, [2, 3], SamplingParams(**params), eos_token_ids=(1,))


def test_greedy_keeps_drafts_while_they_equal_the_argmax():
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([3, 4, 0, 2]):
        logits[row, best] = 5.0
    tokens, _ = Sampler(0, torch.device("cpu")).verify(logits, [req(temperature=0)], [[3, 4, 5]])
    assert tokens == [[3, 4, 0]], "drafts 3 and 4 match the argmax, 5 does not: the argmax 0 replaces it"
    tokens, _ = Sampler(0, torch.device("cpu")).verify(logits, [req(temperature=0)], [[3, 4, 0]])
    assert tokens == [[3, 4, 0, 2]], "every draft accepted: the bonus token comes from the last row"


def test_rows_of_several_requests_and_empty_drafts():
    logits = torch.full((6, VOCAB), -5.0)
    for row, best in enumerate([1, 2, 5, 5, 4, 3]):
        logits[row, best] = 5.0
    tokens, _ = Sampler(0, torch.device("cpu")).verify(
        logits, [req("a", temperature=0), req("b", temperature=0), req("c", temperature=0)], [[1], [], [5, 0]])
    assert tokens == [[1, 2], [5], [5, 4]]
    with pytest.raises(ValueError, match="rows"):
        Sampler(0, torch.device("cpu")).verify(logits[:5], [req("a", temperature=0)], [[1, 2, 3, 4, 5]])


def test_greedy_rows_beside_sampled_ones():
    """All-greedy steps take a shorter path than steps where some row samples: a greedy
    request must get the same tokens on either."""
    logits = torch.full((6, VOCAB), -5.0)
    for row, best in enumerate([1, 2, 5, 5, 4, 3]):
        logits[row, best] = 5.0
    alone, _ = Sampler(0, torch.device("cpu")).verify(logits[:3], [req("a", temperature=0)], [[1, 0]])
    mixed, _ = Sampler(0, torch.device("cpu")).verify(
        logits, [req("a", temperature=0), req("b", temperature=1.0, seed=3)], [[1, 0], [5, 4]])
    assert alone == [[1, 2]] and mixed[0] == alone[0], f"greedy alone {alone}, beside a sampled row {mixed}"


def test_penalties_count_earlier_drafts():
    """A repetition penalty at draft position j sees drafts 0..j-1 as generated: a token
    the run already drafted loses its lead at the next row, as it would one token later."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 3.0, 2.9]] * 2)  # the prompt holds tokens 2 and 3 only
    tokens, _ = Sampler(0, torch.device("cpu")).verify(
        logits, [req(temperature=0, repetition_penalty=2.0)], [[4]])
    assert tokens == [[4, 5]], "row 1 must see draft 4 as generated (3 / 2 < 2.9)"


def test_min_tokens_counts_earlier_drafts():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0, 0.0]] * 3)  # EOS (1) leads every row
    tokens, _ = Sampler(0, torch.device("cpu")).verify(logits, [req(temperature=0, min_tokens=2)], [[2, 2]])
    assert tokens == [[2, 2, 1]], "EOS is banned for the first two outputs only"


def _first_token_counts(p_logits: torch.Tensor, q: torch.Tensor | None, seed: int = 0) -> torch.Tensor:
    """How often each token comes out first when drafts are drawn from q (one-hot at token
    0 when q is None) and verified against the target logits."""
    sampler = Sampler(seed, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(VOCAB)
    batch = 200
    for _ in range(SAMPLES // batch):
        if q is None:
            drafts = [[0]] * batch
            probs = None
        else:
            drafts = torch.multinomial(q, batch, replacement=True, generator=gen)[:, None].tolist()
            probs = q.expand(batch, VOCAB)
        rows = p_logits.repeat(batch * 2, 1)  # draft row and bonus row per request
        requests = [req(str(i), temperature=1.0) for i in range(batch)]
        tokens, _ = sampler.verify(rows, requests, drafts, probs)
        for t in tokens:
            counts[t[0]] += 1
    return counts


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


P_LOGITS = torch.log(torch.tensor([0.05, 0.3, 0.25, 0.2, 0.15, 0.05]))
Q = torch.tensor([0.4, 0.05, 0.05, 0.1, 0.1, 0.3])


@pytest.mark.parametrize("draft", ["one-hot", "q"])
def test_sampled_tokens_keep_the_target_distribution(draft):
    p = torch.softmax(P_LOGITS, -1)
    counts = _first_token_counts(P_LOGITS, None if draft == "one-hot" else Q)
    assert chi_square(counts, p) < CHI2_CRITICAL, f"first tokens {counts.tolist()} do not follow p {p.tolist()}"


@pytest.mark.parametrize("draft", ["one-hot", "q"])
def test_a_broken_sampler_fails_the_same_test(draft, monkeypatch):
    """Resampling from p instead of norm(max(p - q, 0)) after a rejection over-weights
    the drafted tokens: the chi-square test above must catch it."""
    monkeypatch.setattr(sampler_module, "_residual", lambda probs, q, has_draft: probs)
    p = torch.softmax(P_LOGITS, -1)
    counts = _first_token_counts(P_LOGITS, None if draft == "one-hot" else Q)
    assert chi_square(counts, p) > CHI2_CRITICAL, "the broken sampler went unnoticed"


def test_seeded_requests_repeat():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    runs = [Sampler(s, torch.device("cpu")).verify(logits, [req(temperature=1.0, seed=7)], [[0, 1]])[0]
            for s in (0, 1)]
    assert runs[0] == runs[1], "a seeded request's tokens must not depend on the sampler's own seed"


def test_logprobs_of_emitted_tokens():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    best = logits.argmax(-1).tolist()
    tokens, logprobs = Sampler(0, torch.device("cpu")).verify(
        logits, [req(temperature=0, logprobs=1)], [[best[0], (best[1] + 1) % VOCAB]])
    assert tokens == [[best[0], best[1]]]
    assert len(logprobs[0]) == 2
    for row, (token, entry) in enumerate(zip(tokens[0], logprobs[0])):
        assert math.isclose(entry[0], float(torch.log_softmax(logits[row], -1)[token]), rel_tol=1e-5)
