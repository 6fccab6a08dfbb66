"""KV-cache budget: bytes per token, how many blocks fit, and the start-up error that
says what to change when one full-length sequence does not fit.

On the CPU the budget is `kv_cache_memory` bytes or PAGEDLLM_CPU_KVCACHE_SPACE GiB
(default 4). On CUDA it is what remains of `gpu_memory_utilization` x total memory
after the weights and the peak activations of a profiling run.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core import envs

GiB = 1 << 30
DEFAULT_CPU_KV_GIB = 4.0


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    available_bytes: int
    source: str  # how available_bytes was decided, for the start-up log

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def cpu_kv_bytes(kv_cache_memory: int | None) -> tuple[int, str]:
    if kv_cache_memory is not None:
        return kv_cache_memory, "kv_cache_memory"
    value = envs.get("PAGEDLLM_CPU_KVCACHE_SPACE")
    if value is None:
        return int(DEFAULT_CPU_KV_GIB * GiB), f"default {DEFAULT_CPU_KV_GIB:g} GiB"
    try:
        gib = float(value)
    except ValueError:
        raise ValueError(f"{envs.source('PAGEDLLM_CPU_KVCACHE_SPACE')}={value!r} is not a number of GiB") from None
    if gib <= 0:
        raise ValueError(f"{envs.source('PAGEDLLM_CPU_KVCACHE_SPACE')} must be > 0 GiB, got {value}")
    return int(gib * GiB), f"{envs.source('PAGEDLLM_CPU_KVCACHE_SPACE')}={value} GiB"


def plan_kv_cache(available_bytes: int, source: str, bytes_per_token: int, block_size: int,
                  max_model_len: int, max_num_seqs: int, on_gpu: bool,
                  tokens_held_per_seq: int | None = None) -> KVBudget:
    """Blocks that fit in `available_bytes`; never more than all sequences could use.

    `tokens_held_per_seq`: the most tokens one sequence holds at once (default
    max_model_len; less for a model whose every layer is windowed)."""
    bytes_per_block = bytes_per_token * block_size
    blocks_per_seq = -(-(tokens_held_per_seq or max_model_len) // block_size)
    num_blocks = max(0, available_bytes) // bytes_per_block
    if num_blocks < blocks_per_seq:
        raise ValueError(not_enough_memory(blocks_per_seq * bytes_per_block, max(0, available_bytes),
                                           max_model_len, on_gpu, source))
    num_blocks = min(num_blocks, blocks_per_seq * max_num_seqs)
    return KVBudget(int(num_blocks), block_size, bytes_per_token, available_bytes, source)


def not_enough_memory(needed: int, available: int, max_model_len: int, on_gpu: bool, source: str) -> str:
    """The message for a KV cache too small for one max_model_len sequence, with the
    remedies in the order we want users to try them."""
    remedies = [
        f"lower --max-model-len (now {max_model_len})",
        "lower --max-num-seqs (fewer sequences need less activation memory)",
        "use --kv-cache-dtype fp8 (halves KV memory)",
        "use more tensor parallelism (--tensor-parallel-size)",
        "quantize the weights (--quantization)",
    ]
    remedies.append("raise --gpu-memory-utilization" if on_gpu
                    else "give the cache more memory (--kv-cache-memory or PAGEDLLM_CPU_KVCACHE_SPACE)")
    steps = "; ".join(f"{i}) {r}" for i, r in enumerate(remedies, 1))
    return (f"the KV cache cannot hold one sequence of max_model_len={max_model_len} tokens: it needs "
            f"{needed / GiB:.3f} GiB ({needed} bytes) but {available / GiB:.3f} GiB ({available} bytes) "
            f"are available ({source}). Try, in this order: {steps}.")
