"""KV block pool with hash-chained prefix caching.

Invariant: a block is either owned (ref_count > 0, listed in one or more requests'
tables) or in the free list (ref_count == 0), never both. The free list is in eviction
order (least recently freed first); a freed block keeps its hash and stays findable in
the prefix cache until it is handed out again. A full block's hash covers its parent's
hash and its tokens, and a hit is confirmed by comparing token content.

With a `sliding_window` (a model whose every layer attends to at most that many recent
tokens), a running request's blocks wholly older than the window are released as it
advances: they go to the free list (keeping their hash, so they stay findable and
reusable) while the request's table keeps their ids in place, since no kernel reads them
again; `free` skips them later.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from pagedllm.core.request import Request


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


@dataclass(frozen=True)
class KVCacheBlocks:
    """An opaque handle on blocks found in the prefix cache for one request."""

    blocks: tuple[Block, ...] = ()

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        self.req_blocks: dict[str, list[Block]] = {}
        self.sliding_window = sliding_window
        self.released: dict[str, int] = {}  # request id -> its leading blocks already released
        self.num_query_tokens = 0  # prefix-cache statistics, in prompt tokens
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """The request's chained block hashes for its first `num_full_blocks` blocks."""
        bs = self.block_size
        hashes = req.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, req.all_token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, req: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of `req` in whole blocks, and its length in tokens.

        The last token is always left to compute, even on a full hit, because the
        model must run on at least one token to produce the next token's logits.
        """
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            return KVCacheBlocks(), 0  # prompt logprobs need every prompt row computed
        bs = self.block_size
        hits: list[Block] = []
        for i, h in enumerate(self._hashes(req, (req.num_tokens - 1) // bs)):
            block = self.cached.get(h)
            if block is None or block.token_ids != tuple(req.all_token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block)
        return KVCacheBlocks(tuple(hits)), len(hits) * bs

    def num_blocks_to_allocate(self, req: Request, num_new_tokens: int,
                               computed: KVCacheBlocks = KVCacheBlocks()) -> int:
        owned = len(self.req_blocks.get(req.request_id, ())) + len(computed.blocks)
        num_tokens = req.num_computed_tokens + len(computed.blocks) * self.block_size + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - owned)

    def release_outside_window(self, req: Request) -> int:
        """Release `req`'s leading blocks that no layer reads again: every token in them is
        older than the window seen from the next query position (num_computed_tokens).
        Returns how many blocks this freed."""
        if self.sliding_window is None:
            return 0
        table = self.req_blocks.get(req.request_id)
        if not table:
            return 0
        done = self.released.get(req.request_id, 0)
        # block i's last token, (i + 1) * bs - 1, is outside every window of queries at
        # positions >= p when it is <= p - window
        upto = min(len(table), max(0, (req.num_computed_tokens - self.sliding_window + 1) // self.block_size))
        for block in table[done:upto]:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block.block_id] = block
        if upto > done:
            self.released[req.request_id] = upto
        return max(0, upto - done)

    def can_allocate(self, req: Request, num_new_tokens: int, computed: KVCacheBlocks = KVCacheBlocks()) -> bool:
        revived = sum(1 for b in computed.blocks if b.ref_count == 0)
        return self.num_blocks_to_allocate(req, num_new_tokens, computed) <= self.num_free_blocks - revived

    # ------------------------------------------------------------------ actions

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: KVCacheBlocks = KVCacheBlocks()) -> bool:
        """Give `req` room for `num_new_tokens` more tokens (after taking the cached
        `computed` blocks, for a request's first schedule). False, with nothing
        changed (except blocks released outside the window), when the pool is too small."""
        self.release_outside_window(req)
        if not self.can_allocate(req, num_new_tokens, computed):
            return False
        num_new_blocks = self.num_blocks_to_allocate(req, num_new_tokens, computed)
        table = self.req_blocks.setdefault(req.request_id, [])
        if computed.blocks:
            self.num_hit_tokens += len(computed.blocks) * self.block_size
        for block in computed.blocks:
            if block.ref_count == 0:
                del self.free_blocks[block.block_id]
            block.ref_count += 1
            table.append(block)
        for _ in range(num_new_blocks):
            table.append(self._take_free_block())
        return True

    def record_query(self, num_prompt_tokens: int) -> None:
        self.num_query_tokens += num_prompt_tokens

    def _take_free_block(self) -> Block:
        _, block = self.free_blocks.popitem(last=False)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        return block

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's blocks that became full with computed tokens."""
        if not self.enable_caching:
            return
        table = self.req_blocks.get(req.request_id, [])
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        bs = self.block_size
        done = self.released.get(req.request_id, 0)  # released blocks may belong to others now
        for i, h in enumerate(self._hashes(req, num_full)):
            block = table[i]
            if i < done or block.block_hash is not None:
                continue
            block.block_hash = h
            block.token_ids = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
            self.cached.setdefault(h, block)

    def free(self, req: Request) -> None:
        """Release the request's blocks; tail blocks go first into the free list so
        they are evicted before the (more shareable) prefix blocks."""
        done = self.released.pop(req.request_id, 0)
        for block in reversed(self.req_blocks.pop(req.request_id, [])[done:]):
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        for block in self.free_blocks.values():
            block.block_hash = None
            block.token_ids = None
        self.cached = {h: b for h, b in self.cached.items() if b.ref_count > 0}

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0
