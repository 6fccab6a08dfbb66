"""Block pool: exact block ids, prefix hits, LRU eviction, ref counts."""

from __future__ import annotations

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request, SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def admit(bm: BlockManager, req: Request) -> int:
    """Allocate like the scheduler does for a new request; return cached tokens."""
    computed, num_cached = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - num_cached, computed)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return num_cached


def test_allocate_takes_blocks_in_order_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(10)))
    assert admit(bm, req) == 0
    assert bm.block_ids("a") == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.free(req)
    assert bm.num_free_blocks == 8
    # tail block freed first, so it is evicted first
    assert list(bm.free_blocks)[-3:] == [2, 1, 0]


def test_prefix_hit_shares_full_blocks_and_recomputes_last_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    b = make_request("b", list(range(8)) + [99, 98])
    assert admit(bm, b) == 8
    assert bm.block_ids("b")[:2] == bm.block_ids("a")[:2]
    assert bm.blocks[0].ref_count == 2
    # a full hit still leaves the last token to compute
    c = make_request("c", list(range(8)))
    computed, num_cached = bm.get_computed_blocks(c)
    assert num_cached == 4 and computed.block_ids == [0]


def test_freed_cached_blocks_revive_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    b = make_request("b", list(range(9)))
    assert admit(bm, b) == 8  # revived from the free list
    bm.free(b)
    # fill the pool with other content: cached blocks get evicted, LRU first
    c = make_request("c", [50 + i for i in range(16)])
    admit(bm, c)
    assert bm.get_computed_blocks(make_request("d", list(range(9))))[1] == 0


def test_hash_collision_is_confirmed_by_content():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    block = bm.blocks[bm.block_ids("a")[0]]
    block.token_ids = (9, 9, 9, 9)  # simulate a colliding hash with other content
    assert bm.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5]))[1] == 0


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=BS)
    req = make_request("a", list(range(12)))
    assert not bm.allocate_slots(req, 12)
    assert bm.num_free_blocks == 2 and bm.block_ids("a") == []


def test_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_caching=False)
    admit(bm, make_request("a", list(range(9))))
    assert bm.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
