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


def test_sliding_window_releases_blocks_no_query_reads_again():
    """With every layer windowed (window 6, blocks of 4), a block is released once its last
    token is older than the window seen from the next query position; the table keeps the
    ids in place, and free() skips them."""
    bm = BlockManager(num_blocks=6, block_size=BS, sliding_window=6)
    req = make_request("a", list(range(10)))
    admit(bm, req)  # 10 tokens computed: blocks 0, 1, 2
    assert bm.num_free_blocks == 3
    # the next query sits at position 10 and sees keys 5..10: block 0 (tokens 0-3) is out
    assert bm.allocate_slots(req, 1)
    assert bm.block_ids("a") == [0, 1, 2]
    assert bm.num_free_blocks == 4 and bm.blocks[0].ref_count == 0
    req.num_computed_tokens = 15  # next query at 15 sees 10..15: blocks 1 (4-7) and 2 (8-11 holds 10, 11) -> only 1 out
    assert bm.allocate_slots(req, 1)
    assert bm.block_ids("a") == [0, 1, 2, 3]
    assert bm.blocks[1].ref_count == 0 and bm.blocks[2].ref_count == 1
    bm.free(req)
    assert bm.num_free_blocks == 6
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_released_block_reused_by_another_request_is_not_rehashed_or_freed_twice():
    bm = BlockManager(num_blocks=4, block_size=BS, sliding_window=4)
    a = make_request("a", list(range(12)))
    admit(bm, a)
    a.num_computed_tokens = 12
    assert bm.allocate_slots(a, 1)  # query at 12 sees 9..12: blocks 0 and 1 released
    assert bm.num_free_blocks == 2  # a holds its block 2 and a new one; 0 and 1 are free again
    b = make_request("b", [100 + i for i in range(8)])
    admit(bm, b)  # takes the released blocks 0 and 1 (least recently freed first)
    assert sorted(bm.block_ids("b")) == [0, 1]
    before = (bm.blocks[0].block_hash, bm.blocks[1].block_hash)
    bm.cache_full_blocks(a)  # must not stamp a's hashes onto b's blocks
    assert (bm.blocks[0].block_hash, bm.blocks[1].block_hash) == before
    bm.free(a)
    assert bm.blocks[0].ref_count == 1 and bm.blocks[1].ref_count == 1  # still b's
    bm.free(b)
    assert bm.num_free_blocks == 4


def test_no_window_or_a_global_layer_releases_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(20)))
    admit(bm, req)
    assert bm.allocate_slots(req, 1)
    assert bm.num_free_blocks == 8 - 6
