"""TRITON's chunked local attention (Llama 4's `attention_chunk_size` C: a query at p sees
keys floor(p / C) * C .. p) against the TORCH reference, interpreted on a CPU machine.

Each case is one step on a random paged batch (conftest.make_batch: shuffled blocks of
16) mixing decodes and prefill chunks after cached context, with chunk edges inside
blocks, on block edges, inside one prefill tile, and with a sliding window that is the
tighter bound for some queries and the looser for others. Every case first checks that
the chunks change the reference's output, so a kernel ignoring them would fail.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import DEVICE  # noqa: E402
from pagedllm.core.contracts import AttentionSpec  # noqa: E402
from pagedllm.plugins.attention.torch_ref import TorchBackend  # noqa: E402
from pagedllm.plugins.attention.triton_backend import TritonBackend  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3}


@pytest.fixture(autouse=True)
def triton_runs_here():
    spec = AttentionSpec(num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.float32, kv_cache_dtype="auto",
                         block_size=16, device=DEVICE)
    reasons = TritonBackend.check(spec)
    if reasons:
        pytest.fail(f"TRITON cannot run in this test process: {'; '.join(reasons)}")


def run_backend(backend, batch, chunk, window=None, soft_cap=None):
    """One forward on a copy of the batch's cache; returns (output, cache after the write)."""
    cache = batch.kv_cache.clone()
    metadata = backend.builder_cls()(batch.spec).build(batch.layout)
    impl = backend.impl_cls()(batch.spec, batch.scale, window, soft_cap, attention_chunk_size=chunk)
    return impl.forward(batch.q, batch.k, batch.v, cache, metadata), cache


# (requests as (cached tokens, new tokens), batch options, attention options incl. the chunk)
CASES = {
    # C=12: edges at 36 and 48 fall inside blocks 2 and 3; decodes at a chunk's first, a middle
    # and its last position (36, 41, 47); a prefill 30..49 across two edges; one from 0
    "prefill-after-context-and-decodes": ([(30, 20), (36, 1), (41, 1), (47, 1), (0, 14)],
                                          dict(num_heads=4, num_kv_heads=1), dict(chunk=12)),
    # C=16 = block size: edges on block edges; GQA 2 so a prefill tile (64 rows) spans 32 tokens
    "chunk-equals-block": ([(10, 40), (63, 1), (64, 1)], dict(num_heads=4, num_kv_heads=2), dict(chunk=16)),
    # C=5 < block size: several chunks per block and per prefill tile (GQA 8: 8 tokens a tile)
    "small-chunks-gqa8": ([(7, 20), (19, 1)], dict(num_heads=8, num_kv_heads=1), dict(chunk=5)),
    # C=200 over long contexts: the decode splits into several partitions (the one at 450 starts
    # at 400; the one at 400 sees only itself), a prefill crosses the edge at 200
    "long-context-partitions": ([(450, 1), (400, 1), (190, 20)], dict(num_heads=2, num_kv_heads=1),
                                dict(chunk=200)),
    # window 10 with C=12: just after an edge the chunk bounds (pos 37: 36 > 28), late in a
    # chunk the window does (pos 47: 38 > 36)
    "with-window": ([(30, 20), (37, 1), (47, 1)], dict(num_heads=4, num_kv_heads=1), dict(chunk=12, window=10)),
    "with-window-and-soft-cap": ([(25, 15), (44, 1)], dict(num_heads=4, num_kv_heads=2),
                                 dict(chunk=12, window=20, soft_cap=5.0)),
    "float16": ([(30, 12), (45, 1)], dict(num_heads=4, num_kv_heads=1, dtype=torch.float16), dict(chunk=12)),
}


@pytest.mark.parametrize("requests, batch_options, attention_options", CASES.values(), ids=CASES.keys())
def test_chunked_matches_reference(make_paged_batch, requests, batch_options, attention_options):
    batch = make_paged_batch(requests, **batch_options).to(DEVICE)
    chunk = attention_options.pop("chunk")
    ref_out, ref_cache = run_backend(TorchBackend, batch, chunk, **attention_options)
    unchunked, _ = run_backend(TorchBackend, batch, None, **attention_options)
    assert not torch.allclose(ref_out.float(), unchunked.float(), atol=1e-2), "the chunks changed nothing"
    out, cache = run_backend(TritonBackend, batch, chunk, **attention_options)
    assert torch.equal(cache, ref_cache), "the KV write differs from the reference's"
    tol = TOLERANCE[batch.spec.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)


def test_keys_before_the_chunk_are_not_read(make_paged_batch):
    """Chunks bound the key range, not only the mask: poison the blocks wholly before the
    chunk start with NaN (a loaded key or value spreads NaN through the products even where
    masked) and a decode at 450 and a prefill of 410..429 (chunk 200: keys from 400) still
    match the clean reference."""
    batch = make_paged_batch([(450, 1), (410, 20)], num_heads=2, num_kv_heads=1).to(DEVICE)
    ref_out, _ = run_backend(TorchBackend, batch, 200)
    for table in batch.layout.block_tables:
        batch.kv_cache[:, table[:400 // 16].long()] = float("nan")
    out, _ = run_backend(TritonBackend, batch, 200)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


def test_triton_declares_chunk_support():
    assert TritonBackend.supports_attention_chunks
