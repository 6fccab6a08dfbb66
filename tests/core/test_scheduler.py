"""Scheduler: token budget, chunked prefill, decode-first ordering, preemption."""

from __future__ import annotations

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request, SamplingParams
from pagedllm.core.scheduler import Scheduler


def make(num_blocks=16, budget=8, max_seqs=4, chunked=True):
    bm = BlockManager(num_blocks, 4)
    return Scheduler(bm, max_seqs, budget, max_model_len=64, enable_chunked_prefill=chunked), bm


def req(rid, n, max_tokens=4):
    return Request(rid, list(range(2, 2 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(sched, token=7):
    out = sched.schedule()
    sampled = {e.request.request_id: [token] for e in out.scheduled if e.samples}
    sched.update_from_output(out, sampled)
    return out


def test_long_prompt_is_chunked_while_decodes_flow():
    sched, _ = make(budget=8)
    a = req("a", 3)
    sched.add_request(a)
    step(sched)  # a prefilled, one token out
    b = req("b", 20)
    sched.add_request(b)
    out = step(sched)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 1), ("b", 7)]
    assert not out.scheduled[1].samples
    out = step(sched)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 1), ("b", 7)]
    out = step(sched)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 1), ("b", 6)]
    assert out.scheduled[1].samples and b.num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget():
    sched, _ = make(budget=8, chunked=False)
    sched.add_request(req("a", 6))
    sched.add_request(req("b", 6))
    out = step(sched)
    assert [e.request.request_id for e in out.scheduled] == ["a"]


def test_max_num_seqs_limits_running():
    sched, _ = make(budget=64, max_seqs=2)
    for i in range(4):
        sched.add_request(req(str(i), 2))
    out = step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_out_of_blocks_preempts_the_newest_and_recomputes():
    sched, bm = make(num_blocks=4, budget=64, max_seqs=4)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # both hold 2 blocks, pool full
    out = step(sched)  # both need a third block: b is preempted
    assert out.preempted_ids == ("b",)
    assert sched.waiting[0] is b and b.num_computed_tokens == 0
    while sched.has_unfinished:
        step(sched)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert bm.num_free_blocks == 4


def test_abort_frees_blocks():
    sched, bm = make()
    a = req("a", 9)
    sched.add_request(a)
    step(sched)
    assert bm.num_free_blocks < 16
    sched.abort("a")
    assert bm.num_free_blocks == 16 and a.status.value == "abort" and not sched.has_unfinished


def test_speculative_tokens_are_scheduled_and_rejected_ones_rolled_back():
    """The core side of speculative decoding: 1 + k tokens are scheduled for a request
    with k proposals, and after verification only the accepted prefix (plus the token
    sampled in place of the first rejected proposal) counts as computed; a block holding
    a rejected proposal's slot is never registered in the prefix cache."""
    sched, bm = make(budget=8)
    a = req("a", 5, max_tokens=8)
    sched.add_request(a)
    step(sched)  # prefill of 5 tokens, token 7 sampled
    assert (a.num_computed_tokens, a.num_tokens) == (5, 6)
    a.spec_token_ids = [11, 12, 13]  # what a proposer would set before the step
    out = sched.schedule()
    assert [(e.request.request_id, e.num_new_tokens, e.samples) for e in out.scheduled] == [("a", 4, True)]
    assert len(bm.block_ids("a")) == 3, "room for the 9 tokens (5 + 1 + 3 proposals) in blocks of 4"
    # verification kept proposal 11, rejected 12 and sampled 99 in its place
    sched.update_from_output(out, {"a": [11, 99]})
    assert a.output_token_ids == [7, 11, 99]
    assert a.spec_token_ids == []
    assert a.num_computed_tokens == 7, "the rejected proposals' KV must count as not computed"
    assert len(bm.cached) == 1, "only block 0 is full of computed tokens; block 1 holds 99 uncomputed"
    out = step(sched)
    assert [(e.num_computed_tokens, e.num_new_tokens) for e in out.scheduled] == [(7, 1)]
