"""The CPU KV cache's first blocks are faulted in at start-up (PAGEDLLM_CPU_KV_PREFAULT_MB),
the rest while a serving engine idles (IdleFaultIn)."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.core.memory import KVBudget, cpu_prefault_blocks
from pagedllm.core.worker import PAGE_BYTES, IdleFaultIn, prefault


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


def test_prefault_of_the_whole_cache_writes_it_all():
    """A prefault as large as the cache (PAGEDLLM_CPU_KV_PREFAULT_MB over its size): no
    dimension differs, and every block is written (it used to write none)."""
    caches = [torch.ones(2, 10, 16, 3, 8) for _ in range(2)]
    assert prefault(caches, (2, 10, 16, 3, 8), (2, 10, 16, 3, 8)) == 2 * caches[0].numel() * 4
    assert all(cache.eq(0).all() for cache in caches), "a whole-cache prefault left blocks unwritten"


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


def test_idle_fault_in_walks_every_page_and_keeps_contents():
    """Chunk by chunk over every layer's cache (empty placeholders skipped), writing one byte
    per page with its own value: blocks in use or holding a cached prefix keep their data."""
    caches = [torch.randn(3, PAGE_BYTES) for _ in range(2)] + [torch.empty(0)] + \
        [torch.randn(PAGE_BYTES // 2, dtype=torch.float64).to(torch.bfloat16)]
    before = [c.clone() for c in caches]
    total = sum(c.numel() * c.element_size() for c in caches)
    fault_in = IdleFaultIn(caches)
    turns = 0
    while fault_in.step(5 * PAGE_BYTES):
        turns += 1
        assert turns < 100, "the walk never ends"
    assert fault_in.done and not fault_in.step(PAGE_BYTES)
    assert turns + 1 == -(-total // (5 * PAGE_BYTES)), f"{turns + 1} turns for {total} bytes in 5-page chunks"
    for cache, old in zip(caches, before):
        assert torch.equal(cache, old), "faulting in changed the cache's contents"


def test_idle_fault_in_stops_where_memory_runs_short(monkeypatch):
    """A cache sized beyond the memory left must not be faulted in by idling: it stops for
    good once available memory nears IDLE_FAULT_IN_RESERVE (or cannot be read)."""
    from pagedllm.core import worker

    caches = [torch.ones(4, PAGE_BYTES)]
    available = [worker.IDLE_FAULT_IN_RESERVE + (64 << 20)]
    monkeypatch.setattr(worker, "memory_available", lambda: available[0])
    fault_in = IdleFaultIn(caches)
    assert fault_in.step(PAGE_BYTES) and not fault_in.done, "plenty of memory: it should go on"
    available[0] = worker.IDLE_FAULT_IN_RESERVE
    assert not fault_in.step(PAGE_BYTES) and fault_in.done, "it went on with the reserve reached"
    assert caches[0].eq(1).all()
    monkeypatch.setattr(worker, "memory_available", lambda: None)
    assert not IdleFaultIn([torch.ones(4, PAGE_BYTES)]).step(PAGE_BYTES), "unknown memory: no idle fault-in"


def test_engine_faults_in_the_rest_only_when_the_prefault_is_not_sized(tiny_model_dir, monkeypatch):
    from pagedllm import LLM

    monkeypatch.delenv("PAGEDLLM_CPU_KV_PREFAULT_MB", raising=False)
    llm = LLM(model=str(tiny_model_dir()), kv_cache_memory=8 << 20)
    assert llm.engine.worker.idle_fault_in is not None, "no idle fault-in with the default prefault"
    turns = 0
    while llm.engine.idle_work():
        turns += 1
    assert llm.engine.worker.idle_fault_in.done and 1 <= turns + 1 <= 4, f"{turns + 1} turns for an 8 MiB cache"
    monkeypatch.setenv("PAGEDLLM_CPU_KV_PREFAULT_MB", "1")
    sized = LLM(model=str(tiny_model_dir()), kv_cache_memory=8 << 20)
    assert sized.engine.worker.idle_fault_in is None and not sized.engine.idle_work(), \
        "a sized prefault is the whole prefault: nothing more is faulted while idle"


def test_serving_engine_faults_in_while_idle(tiny_model_dir, monkeypatch):
    """The serving loop does the idle work between requests, by itself."""
    import time

    from pagedllm.core.config import EngineConfig
    from pagedllm.core.engine import AsyncLLMEngine

    monkeypatch.delenv("PAGEDLLM_CPU_KV_PREFAULT_MB", raising=False)
    engine = AsyncLLMEngine.from_config(EngineConfig.from_kwargs(model=str(tiny_model_dir()),
                                                                 kv_cache_memory=16 << 20, device="cpu"))
    try:
        fault_in = engine.engine.worker.idle_fault_in
        deadline = time.monotonic() + 10
        while not fault_in.done and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fault_in.done, "an idle serving engine did not fault its cache in"
    finally:
        engine.shutdown()
