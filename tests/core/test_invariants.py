"""Block manager + scheduler invariants under random workloads (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request, SamplingParams
from pagedllm.core.scheduler import Scheduler

BS = 4

workload = st.lists(
    st.tuples(
        st.lists(st.integers(0, 5), min_size=1, max_size=30),  # prompt from a tiny alphabet: many shared prefixes
        st.integers(1, 12),  # max_tokens
        st.integers(0, 3),  # arrival step
        st.booleans(),  # aborted midway
    ),
    min_size=1,
    max_size=12,
)


def check_invariants(bm: BlockManager, sched: Scheduler) -> None:
    owners: dict[int, int] = {}
    for blocks in bm.req_blocks.values():
        for b in blocks:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
    for block in bm.blocks:
        in_free = block.block_id in bm.free_blocks
        assert in_free == (block.ref_count == 0), f"{block} free-list membership disagrees with ref count"
        assert owners.get(block.block_id, 0) == block.ref_count, f"{block} ref count != owners"
    for h, block in bm.cached.items():
        assert block.block_hash == h and block.token_ids is not None
    # shared blocks hold the same tokens for every owner
    for rid, blocks in bm.req_blocks.items():
        req = sched.requests[rid]
        for i, b in enumerate(blocks):
            if b.token_ids is not None:
                assert b.token_ids == tuple(req.all_token_ids[i * BS:(i + 1) * BS]), "cached block shared with other content"
    for req in sched.running:
        assert len(bm.req_blocks[req.request_id]) * BS >= req.num_computed_tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload, st.integers(6, 40), st.integers(1, 24), st.integers(1, 6), st.booleans())
def test_every_request_finishes_and_no_block_leaks(items, num_blocks, budget, max_seqs, caching):
    bm = BlockManager(num_blocks, BS, enable_caching=caching)
    sched = Scheduler(bm, max_seqs, budget, max_model_len=num_blocks * BS, enable_chunked_prefill=True)
    reqs = []
    for i, (prompt, max_tokens, arrival, aborted) in enumerate(items):
        prompt = prompt[: num_blocks * BS - 1]
        reqs.append((arrival, aborted, Request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))))
    steps = 0
    while steps < 2000:
        for arrival, _, r in reqs:
            if arrival == steps:
                sched.add_request(r)
        if steps > 3 and not sched.has_unfinished:
            break
        out = sched.schedule()
        sampled = {e.request.request_id: [(steps * 7 + len(e.request.all_token_ids)) % 6]
                   for e in out.scheduled if e.samples}
        sched.update_from_output(out, sampled)
        for arrival, aborted, r in reqs:
            if aborted and steps == arrival + 2:
                sched.abort(r.request_id)
        check_invariants(bm, sched)
        steps += 1
    assert all(r.is_finished for _, _, r in reqs), "a request never finished"
    assert bm.num_free_blocks == num_blocks, "blocks leaked"
    for _, aborted, r in reqs:
        if r.status.value == "length":
            assert r.num_output_tokens == r.params.max_tokens or r.num_tokens >= num_blocks * BS
