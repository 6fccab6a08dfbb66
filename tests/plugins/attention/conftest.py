"""Factories for random paged attention inputs shared by the attention-backend tests.

`make_paged_batch` builds one step: requests given as (cached tokens, new tokens), each
with its own shuffled (non-contiguous) blocks, a cache in the reference layout filled
with random K/V, and q/k/v for the new tokens. Backends are compared against the TORCH
reference on the same batch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import Callable

import pytest
import torch

# Without a GPU, Triton kernels can only run interpreted, and the interpreter must be on
# before triton is first imported (triton jits its own tl.sum/tl.max at import). Tests run
# after collection, so switching it on here covers every test of the session; with CUDA
# the kernels compile and run on the GPU instead.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

from pagedllm.core.contracts import AttentionSpec, BatchLayout, kv_cache_torch_dtype


@dataclass
class PagedBatch:
    spec: AttentionSpec
    layout: BatchLayout
    q: torch.Tensor  # [num_tokens, num_heads, head_size]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    v: torch.Tensor
    kv_cache: torch.Tensor  # reference layout [2, num_blocks, block_size, num_kv_heads, head_size]
    scale: float

    def to(self, device: str | torch.device) -> "PagedBatch":
        device = torch.device(device)
        return PagedBatch(
            spec=replace(self.spec, device=device), layout=layout_to(self.layout, device),
            q=self.q.to(device), k=self.k.to(device), v=self.v.to(device),
            kv_cache=self.kv_cache.to(device), scale=self.scale)


def layout_to(layout: BatchLayout, device: str | torch.device) -> BatchLayout:
    """The layout with its device tensors on `device` (the *_cpu copies stay)."""
    fields = {name: getattr(layout, name).to(device) for name in (
        "input_ids", "positions", "slot_mapping", "block_tables", "query_start_loc", "seq_lens")}
    return replace(layout, **fields)


def build_layout(requests: list[tuple[int, int]], block_size: int, num_blocks: int,
                 generator: torch.Generator) -> BatchLayout:
    """A BatchLayout for requests of (cached tokens, new tokens), blocks drawn at random."""
    seq_lens = [cached + new for cached, new in requests]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    if sum(blocks_needed) > num_blocks:
        raise ValueError(f"{sum(blocks_needed)} blocks needed, {num_blocks} available")
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(requests), max(blocks_needed), dtype=torch.int32)
    positions, slots, query_start_loc = [], [], [0]
    for i, ((cached, new), n_blocks) in enumerate(zip(requests, blocks_needed)):
        table = [pool.pop() for _ in range(n_blocks)]
        block_tables[i, :n_blocks] = torch.tensor(table, dtype=torch.int32)
        for pos in range(cached, cached + new):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + new)
    qsl = torch.tensor(query_start_loc, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return BatchLayout(
        input_ids=torch.zeros(len(positions), dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables, query_start_loc=qsl, seq_lens=lens,
        query_start_loc_cpu=qsl.clone(), seq_lens_cpu=lens.clone(),
        max_query_len=max(new for _, new in requests), max_seq_len=max(seq_lens), block_size=block_size,
    )


def make_batch(requests: list[tuple[int, int]], *, num_heads: int = 4, num_kv_heads: int = 1,
               head_size: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32,
               kv_cache_dtype: str = "auto", extra_blocks: int = 3, seed: int = 0) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in requests) + extra_blocks
    layout = build_layout(requests, block_size, num_blocks, gen)
    spec = AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                         kv_cache_dtype=kv_cache_dtype, block_size=block_size, device=torch.device("cpu"))
    num_tokens = layout.num_tokens
    q = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    kv_cache = cache.to(kv_cache_torch_dtype(kv_cache_dtype, dtype))
    return PagedBatch(spec, layout, q, k, v, kv_cache, scale=head_size**-0.5)


@pytest.fixture
def make_paged_batch() -> Callable[..., PagedBatch]:
    """Factory: make_paged_batch([(cached, new), ...], num_heads=..., ...) -> PagedBatch."""
    return make_batch
