"""The CPU KV cache's first blocks are faulted in at start-up (PAGEDLLM_CPU_KV_PREFAULT_MB)."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.core.memory import KVBudget, cpu_prefault_blocks
from pagedllm.core.worker import prefault


@pytest.mark.parametrize("layout", [
    lambda n: (2, n, 16, 3, 8),  # the default: K then V, blocks second
    lambda n: (n, 16, 24),  # MLA's latent cache: blocks first
    lambda n: (4, 2, n, 16),  # blocks third
])
def test_prefault_writes_the_first_blocks_of_any_layout(layout):
    full, head = layout(10), layout(3)
    caches = [torch.ones(full) for _ in range(2)] + [torch.ones(0)]  # a placeholder layer stays as it is
    written = prefault(caches, full, head)
    dim = next(i for i, (a, b) in enumerate(zip(full, head)) if a != b)
    for cache in caches[:2]:
        assert cache.narrow(dim, 0, 3).eq(0).all(), "the first 3 blocks were not written"
        assert cache.narrow(dim, 3, 7).eq(1).all(), "blocks past the first 3 were written"
    assert written == 2 * torch.zeros(head).numel() * 4


def test_prefault_leaves_a_layout_it_cannot_place():
    cache = torch.ones(4, 10, 6)
    assert prefault([cache], (4, 10, 6), (2, 3, 6)) == 0  # two dimensions differ: which is the block's?
    assert prefault([cache], (4, 10, 6), (3, 6)) == 0
    assert cache.eq(1).all()


def _budget(num_blocks: int) -> KVBudget:
    return KVBudget(num_blocks=num_blocks, block_size=16, bytes_per_token=1024, available_bytes=0, source="test")


def test_prefault_blocks_follow_the_env(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_CPU_KV_PREFAULT_MB", raising=False)
    assert cpu_prefault_blocks(_budget(100_000)) == (256 << 20) // (16 * 1024)  # the default, 256 MiB
    assert cpu_prefault_blocks(_budget(10)) == 10  # never more than the cache
    monkeypatch.setenv("PAGEDLLM_CPU_KV_PREFAULT_MB", "1")
    assert cpu_prefault_blocks(_budget(100_000)) == 64
    monkeypatch.setenv("PAGEDLLM_CPU_KV_PREFAULT_MB", "0")
    assert cpu_prefault_blocks(_budget(100_000)) == 0
    monkeypatch.setenv("PAGEDLLM_CPU_KV_PREFAULT_MB", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KV_PREFAULT_MB='lots' is not a whole number"):
        cpu_prefault_blocks(_budget(10))


def test_engine_faults_in_its_first_blocks(tiny_model_dir, monkeypatch, caplog):
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_CPU_KV_PREFAULT_MB", "1")
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(tiny_model_dir()), kv_cache_memory=64 << 20, max_num_seqs=256)
    budget = llm.engine.worker.budget
    blocks = cpu_prefault_blocks(budget)
    assert 0 < blocks < budget.num_blocks, "1 MiB should be part of this cache"
    mib = blocks * budget.block_size * budget.bytes_per_token / (1 << 20)
    said = [r.getMessage() for r in caplog.records if "faulted in" in r.getMessage()]
    assert said and said[0].startswith(f"KV cache: the first {blocks} blocks faulted in ({mib:.1f} MiB"), said
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
