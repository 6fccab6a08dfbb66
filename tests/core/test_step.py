"""The step message (core/step.py): what a rank rebuilds from the messages alone equals
what the driver reads from its live requests, step after step, through chunked prefill,
prefix caching, preemption, aborts and speculative tokens."""

from __future__ import annotations

import pickle

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request, SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step import RankRequests, StepEncoder

BS = 4

workload = st.lists(
    st.tuples(
        st.lists(st.integers(0, 5), min_size=1, max_size=30),
        st.integers(1, 12),  # max_tokens
        st.integers(0, 3),  # arrival step
        st.booleans(),  # aborted midway
        st.integers(0, 2),  # drafts proposed per decode step
    ),
    min_size=1,
    max_size=10,
)


def expected(out):
    """What the worker fed the model before the message existed: from the live requests."""
    tokens, tables = [], []
    for e in out.scheduled:
        ids = e.request.all_token_ids
        start = e.num_computed_tokens
        end = start + e.num_new_tokens - len(e.spec_token_ids)
        tokens.append(ids[start:end] + list(e.spec_token_ids))
        tables.append(list(e.block_ids))
    return tokens, tables


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload, st.integers(6, 30), st.integers(1, 20), st.integers(1, 5), st.booleans())
def test_rank_rebuilds_every_step_from_messages(items, num_blocks, budget, max_seqs, caching):
    bm = BlockManager(num_blocks, BS, enable_caching=caching)
    sched = Scheduler(bm, max_seqs, budget, max_model_len=num_blocks * BS, enable_chunked_prefill=True)
    encoder, rank = StepEncoder(), RankRequests()
    reqs = []
    for i, (prompt, max_tokens, arrival, aborted, drafts) in enumerate(items):
        req = Request(str(i), prompt[: num_blocks * BS - 4], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        reqs.append((arrival, aborted, drafts, req))
    forgotten: set[str] = set()
    for step in range(400):
        for arrival, _, _, r in reqs:
            if arrival == step:
                sched.add_request(r)
        if step > 3 and not sched.has_unfinished:
            break
        out = sched.schedule()
        msg = pickle.loads(pickle.dumps(encoder.encode(out)))  # what crosses to a rank
        assert rank.apply(msg) == expected(out), f"step {step}: the rank's batch differs from the driver's"
        sampled = {}
        for e in out.scheduled:
            if e.samples:  # accept the first draft when there is one, then the "target" token
                sampled[e.request.request_id] = list(e.spec_token_ids[:1]) + [(step * 7 + e.request.num_tokens) % 6]
        sched.update_from_output(out, sampled)
        for arrival, aborted, drafts, r in reqs:
            if aborted and step == arrival + 2:
                sched.abort(r.request_id)
            if not r.is_finished and r.num_output_tokens and drafts:
                r.spec_token_ids = [(step + j) % 6 for j in range(drafts)]
        for _, _, _, r in reqs:
            if r.is_finished and r.request_id not in forgotten:
                forgotten.add(r.request_id)
                encoder.forget(r.request_id)
    assert all(r.is_finished for *_, r in reqs)
    rank.apply(encoder.encode(sched.schedule()))  # the last forgotten ids travel with the next step
    assert len(rank) == 0, "a rank still holds finished requests"


def test_running_requests_carry_only_what_is_new():
    bm = BlockManager(16, BS, enable_caching=False)
    sched = Scheduler(bm, 4, 64, max_model_len=64)
    sched.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=5, ignore_eos=True)))
    encoder = StepEncoder()
    out = sched.schedule()
    first = encoder.encode(out).scheduled[0]
    assert first.new and first.token_ids == tuple(range(10)) and len(first.block_ids) == 3
    sched.update_from_output(out, {"a": [42]})
    second = encoder.encode(sched.schedule()).scheduled[0]
    assert not second.new and second.token_ids == (42,) and second.block_ids == ()


def test_preempted_request_is_sent_again_in_full():
    bm = BlockManager(16, BS, enable_caching=False)
    sched = Scheduler(bm, 4, 64, max_model_len=64)
    sched.add_request(Request("a", list(range(6)), SamplingParams(max_tokens=5, ignore_eos=True)))
    encoder = StepEncoder()
    out = sched.schedule()
    encoder.encode(out)
    sched.update_from_output(out, {"a": [7]})
    out = sched.schedule()
    preempted = type(out)(out.scheduled, preempted_ids=("a",))
    msg = encoder.encode(preempted)
    assert msg.forgotten_ids == ("a",) and msg.scheduled[0].new
    assert msg.scheduled[0].token_ids == tuple(range(6)) + (7,)
