"""Config validation, env aliases and the KV memory planner."""

from __future__ import annotations

import pytest

from pagedllm.core import envs
from pagedllm.core.config import EngineConfig
from pagedllm.core.memory import GiB, cpu_kv_bytes, plan_kv_cache


def test_kwargs_are_distributed_and_validated():
    cfg = EngineConfig.from_kwargs(model="m", block_size=32, max_num_seqs=8, device="cpu")
    assert cfg.model.model == "m" and cfg.cache.block_size == 32 and cfg.scheduler.max_num_seqs == 8
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_kwargs(block_size=24)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.from_kwargs(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)
    parallel = EngineConfig.from_kwargs(tensor_parallel_size=2, pipeline_parallel_size=2).parallel
    assert parallel.world_size == 4 and parallel.executor_backend == "mp"
    assert EngineConfig.from_kwargs().parallel.executor_backend == "uni"
    with pytest.raises(ValueError, match="data_parallel_rank=2 is outside"):
        EngineConfig.from_kwargs(data_parallel_size=2, data_parallel_rank=2)


def test_budget_without_chunked_prefill_must_cover_context():
    cfg = EngineConfig.from_kwargs(enable_chunked_prefill=False, max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        cfg.max_num_batched_tokens(4096)


def test_env_alias_and_precedence(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert cpu_kv_bytes(None) == (2 * GiB, "VLLM_CPU_KVCACHE_SPACE=2 GiB")
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "1")
    assert cpu_kv_bytes(None)[0] == GiB
    assert cpu_kv_bytes(123)[0] == 123
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KVCACHE_SPACE"):
        cpu_kv_bytes(None)
    assert envs.ENV_VARS["PAGEDLLM_ATTENTION_BACKEND"].alias == "VLLM_ATTENTION_BACKEND"


def test_plan_caps_blocks_and_explains_shortfall():
    budget = plan_kv_cache(10 * GiB, "test", bytes_per_token=1024, block_size=16, max_model_len=64,
                           max_num_seqs=2, on_gpu=False)
    assert budget.num_blocks == 8  # never more than 2 sequences x 4 blocks
    with pytest.raises(ValueError) as err:
        plan_kv_cache(1000, "test", 1024, 16, 64, 2, on_gpu=True)
    msg = str(err.value)
    order = ["--max-model-len", "--max-num-seqs", "--kv-cache-dtype fp8", "tensor parallelism",
             "quantize", "--gpu-memory-utilization"]
    positions = [msg.index(s) for s in order]
    assert positions == sorted(positions), msg


def test_structured_outputs_config_keys_are_checked():
    import pytest

    from pagedllm.core.config import EngineConfig

    assert EngineConfig.from_kwargs(structured_outputs_config={"backend": "xgrammar"}).structured.options == {
        "backend": "xgrammar"}
    with pytest.raises(ValueError, match="unknown keys \\['bakend'\\]"):
        EngineConfig.from_kwargs(structured_outputs_config={"bakend": "xgrammar"})
    with pytest.raises(ValueError, match="--reasoning-parser"):
        EngineConfig.from_kwargs(structured_outputs_config={"reasoning_parser": "deepseek_r1"})


def test_an_empty_speculative_config_is_refused():
    import pytest

    from pagedllm.core.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_config is empty"):
        EngineConfig.from_kwargs(speculative_config={})
