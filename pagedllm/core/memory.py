"""KV-cache budget: bytes per token, how many blocks fit, and the start-up error that
says what to change when one full-length sequence does not fit.

On the CPU the budget is `kv_cache_memory` bytes or PAGEDLLM_CPU_KVCACHE_SPACE GiB
(default 4). On CUDA it is what remains of `gpu_memory_utilization` x total memory
after the weights and the peak activations of a profiling run.

The arithmetic is shared: the worker's start-up check (`plan_kv_cache`) and
`pagedllm plan` (which sizes a model before anything is loaded) call the same functions
below for one rank's cache, and describe a shortfall with the same `Remedy` list, in
the order we want users to try them: max-model-len, max-num-seqs, fp8 KV cache, more
tensor parallelism, weight quantization, more memory. Each remedy carries its number
where the caller knows enough to compute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from pagedllm.core import envs
from pagedllm.core.contracts.model import KVCacheSpec

GiB = 1 << 30
DEFAULT_CPU_KV_GIB = 4.0
FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


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


DEFAULT_CPU_KV_PREFAULT_MIB = 256


def cpu_prefault_blocks(budget: KVBudget) -> int:
    """How many of the CPU KV cache's first blocks (the ones handed out first) to fault in
    at start-up: PAGEDLLM_CPU_KV_PREFAULT_MB (default 256 MiB over every layer, target and
    proposer together), at most the whole cache."""
    value = envs.get("PAGEDLLM_CPU_KV_PREFAULT_MB")
    mib = DEFAULT_CPU_KV_PREFAULT_MIB
    if value is not None:
        if not value.strip().isdigit():
            raise ValueError(f"{envs.source('PAGEDLLM_CPU_KV_PREFAULT_MB')}={value!r} is not a whole number of MiB")
        mib = int(value)
    return min(budget.num_blocks, (mib << 20) // max(1, budget.bytes_per_token * budget.block_size))


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


# ---------------------------------------------------------------------- one rank's arithmetic


def kv_element_size(kv_cache_dtype: str, dtype_size: int) -> int:
    """Bytes per cached element: 1 for an fp8 cache, else the model dtype's (`auto`)."""
    return 1 if kv_cache_dtype in FP8_KV_DTYPES else dtype_size


def rank_bytes_per_token(spec: KVCacheSpec, element_size: int, tp_size: int = 1, layers: int | None = None) -> int:
    """KV bytes one token takes on one rank: its share of the heads (`for_tensor_parallel`)
    over the `layers` its pipeline stage holds (default: all)."""
    return spec.for_tensor_parallel(tp_size).bytes_per_token(element_size, layers)


def blocks_per_sequence(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def sequence_bytes(bytes_per_token: int, block_size: int, tokens: int) -> int:
    """Cache bytes of one sequence of `tokens` tokens: whole blocks."""
    return blocks_per_sequence(tokens, block_size) * block_size * bytes_per_token


def sequences_that_fit(available_bytes: int, bytes_per_token: int, block_size: int, tokens_per_seq: int) -> int:
    """Sequences of `tokens_per_seq` tokens the cache holds at once (0 when not one)."""
    num_blocks = max(0, available_bytes) // (bytes_per_token * block_size)
    return int(num_blocks // blocks_per_sequence(tokens_per_seq, block_size))


def longest_sequence_that_fits(available_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """The longest max_model_len one sequence can have in this cache (whole blocks; 0: none)."""
    return int(max(0, available_bytes) // (bytes_per_token * block_size) * block_size)


def tokens_held_per_seq(max_model_len: int, kv_window: int | None, max_num_batched_tokens: int,
                        block_size: int) -> int:
    """The most tokens one sequence ever holds in the cache: max_model_len, or, when every
    layer is windowed (`kv_window`: blocks older than it are released), the window plus the
    largest step's new tokens and a block for alignment."""
    if kv_window is None:
        return max_model_len
    return min(max_model_len, kv_window + max_num_batched_tokens + block_size)


def utilization_needed(total_bytes: int, utilization: float, shortfall_bytes: int) -> float | None:
    """The --gpu-memory-utilization that covers `shortfall_bytes` more (rounded up to a
    hundredth), or None when even all of the device would not."""
    needed = math.ceil((utilization + max(0, shortfall_bytes) / total_bytes) * 100 - 1e-9) / 100
    return needed if needed <= 1.0 else None


# ---------------------------------------------------------------------- remedies


@dataclass(frozen=True)
class Remedy:
    """One change that would let a sequence fit, and what it gives (`fits`: whether this
    change alone is enough; None when the caller could not compute it)."""

    key: str  # max_model_len, max_num_seqs, kv_cache_dtype, tensor_parallel_size, quantization, memory
    text: str
    fits: bool | None = None

    def __str__(self) -> str:
        verdict = {True: "", False: " (not enough alone)", None: ""}[self.fits]
        return self.text + verdict


def seqs_phrase(seqs: int, tokens: int) -> str:
    return f"{seqs} sequence{'' if seqs == 1 else 's'} of {tokens} tokens fit{'s' if seqs == 1 else ''}"


def remedy_max_model_len(now: int, longest: int | None = None) -> Remedy:
    if longest is None:
        return Remedy("max_model_len", f"lower --max-model-len (now {now})")
    if longest <= 0:
        return Remedy("max_model_len", f"lower --max-model-len (now {now}): no length fits, the cache has no "
                                       "room left for one block", False)
    return Remedy("max_model_len", f"lower --max-model-len to {longest} (now {now})", True)


def remedy_max_num_seqs(now: int | None = None, value: int | None = None, result: str | None = None,
                        fits: bool | None = None) -> Remedy:
    if value is None:
        now_text = "" if now is None else f"now {now}; "
        return Remedy("max_num_seqs", f"lower --max-num-seqs ({now_text}fewer sequences need less activation "
                                      "memory)" + (f": {result}" if result else ""), fits)
    return Remedy("max_num_seqs", f"lower --max-num-seqs to {value} (now {now}; less activation memory): {result}",
                  fits)


def remedy_fp8_kv(element_size: int | None = None, result: str | None = None, fits: bool | None = None) -> Remedy:
    if element_size is None or result is None:
        return Remedy("kv_cache_dtype", "use --kv-cache-dtype fp8 (halves KV memory)")
    return Remedy("kv_cache_dtype", f"use --kv-cache-dtype fp8 (1 byte per element instead of {element_size}): "
                                    f"{result}", fits)


def remedy_tensor_parallel(value: int | None = None, result: str | None = None, fits: bool | None = None) -> Remedy:
    if value is None:
        return Remedy("tensor_parallel_size", "use more tensor parallelism (--tensor-parallel-size)"
                      + (f": {result}" if result else ""), fits)
    return Remedy("tensor_parallel_size", f"use more tensor parallelism (--tensor-parallel-size {value}): {result}",
                  fits)


def remedy_quantize(method: str | None = None, result: str | None = None, fits: bool | None = None) -> Remedy:
    if method is None:
        return Remedy("quantization", "quantize the weights (--quantization)")
    return Remedy("quantization", f"quantize the weights (--quantization {method}): {result}", fits)


def remedy_memory(on_gpu: bool, source: str, needed_bytes: int | None = None, shortfall_bytes: int | None = None,
                  total_bytes: int | None = None, utilization: float | None = None) -> Remedy:
    """More memory for the cache, said the way the budget was decided: --kv-cache-memory
    when it was given, --gpu-memory-utilization on a GPU, PAGEDLLM_CPU_KVCACHE_SPACE on the CPU."""
    if source == "kv_cache_memory":
        if needed_bytes is None:
            return Remedy("memory", "raise --kv-cache-memory")
        return Remedy("memory", f"raise --kv-cache-memory to {needed_bytes} ({_gib(needed_bytes)})", True)
    if not on_gpu:
        if needed_bytes is None:
            return Remedy("memory", "give the cache more memory (--kv-cache-memory or PAGEDLLM_CPU_KVCACHE_SPACE)")
        gib = math.ceil(needed_bytes / GiB * 100) / 100
        return Remedy("memory", f"give the cache more memory (--kv-cache-memory {needed_bytes} or "
                                f"PAGEDLLM_CPU_KVCACHE_SPACE={gib:g})", True)
    if total_bytes is None or utilization is None or shortfall_bytes is None:
        return Remedy("memory", "raise --gpu-memory-utilization")
    needed = utilization_needed(total_bytes, utilization, shortfall_bytes)
    if needed is None:
        return Remedy("memory", f"raise --gpu-memory-utilization (now {utilization:g}): even 1.0 leaves "
                                f"{_gib(shortfall_bytes - int((1.0 - utilization) * total_bytes))} too little", False)
    return Remedy("memory", f"raise --gpu-memory-utilization to {needed:g} (now {utilization:g})", True)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB // 10 else f"{n / (1 << 20):.2f} MiB"


def kv_remedies(available_bytes: int, source: str, bytes_per_token: int, block_size: int, max_model_len: int,
                max_num_seqs: int, on_gpu: bool, tokens_held: int, kv_element_size: int | None = None,
                total_bytes: int | None = None, gpu_memory_utilization: float | None = None) -> list[Remedy]:
    """The six remedies with the numbers one rank's cache facts give: the longest
    max_model_len that fits, what an fp8 cache holds (when the element size is known),
    the utilization or cache size needed (when the device's total is known)."""
    needed = sequence_bytes(bytes_per_token, block_size, tokens_held)
    shortfall = needed - max(0, available_bytes)
    fp8 = remedy_fp8_kv()
    if kv_element_size is not None and kv_element_size > 1:
        seqs = sequences_that_fit(available_bytes, bytes_per_token // kv_element_size, block_size, tokens_held)
        fp8 = remedy_fp8_kv(kv_element_size, seqs_phrase(seqs, max_model_len), seqs >= 1)
    return [
        remedy_max_model_len(max_model_len, longest_sequence_that_fits(available_bytes, bytes_per_token, block_size)),
        remedy_max_num_seqs(max_num_seqs),
        fp8,
        remedy_tensor_parallel(),
        remedy_quantize(),
        remedy_memory(on_gpu, source, needed, shortfall, total_bytes, gpu_memory_utilization),
    ]


# ---------------------------------------------------------------------- the start-up check


def plan_kv_cache(available_bytes: int, source: str, bytes_per_token: int, block_size: int,
                  max_model_len: int, max_num_seqs: int, on_gpu: bool,
                  tokens_held_per_seq: int | None = None, *, kv_element_size: int | None = None,
                  total_bytes: int | None = None, gpu_memory_utilization: float | None = None) -> KVBudget:
    """Blocks that fit in `available_bytes`; never more than all sequences could use.

    `tokens_held_per_seq`: the most tokens one sequence holds at once (default
    max_model_len; less for a model whose every layer is windowed). The keyword-only
    facts only sharpen the error's remedies: the cache's element size (what fp8 would
    hold), the device's total memory and the utilization in force (the utilization that
    would be enough)."""
    tokens_held = tokens_held_per_seq or max_model_len
    bytes_per_block = bytes_per_token * block_size
    blocks_per_seq = blocks_per_sequence(tokens_held, block_size)
    num_blocks = max(0, available_bytes) // bytes_per_block
    if num_blocks < blocks_per_seq:
        remedies = kv_remedies(available_bytes, source, bytes_per_token, block_size, max_model_len, max_num_seqs,
                               on_gpu, tokens_held, kv_element_size, total_bytes, gpu_memory_utilization)
        raise ValueError(not_enough_memory(blocks_per_seq * bytes_per_block, max(0, available_bytes),
                                           max_model_len, on_gpu, source, remedies))
    num_blocks = min(num_blocks, blocks_per_seq * max_num_seqs)
    return KVBudget(int(num_blocks), block_size, bytes_per_token, available_bytes, source)


def not_enough_memory(needed: int, available: int, max_model_len: int, on_gpu: bool, source: str,
                      remedies: Sequence[Remedy] | None = None) -> str:
    """The message for a KV cache too small for one max_model_len sequence, with the
    remedies in the order we want users to try them (`remedies`: with their numbers;
    default: the six without numbers)."""
    if remedies is None:
        remedies = [remedy_max_model_len(max_model_len), remedy_max_num_seqs(), remedy_fp8_kv(),
                    remedy_tensor_parallel(), remedy_quantize(), remedy_memory(on_gpu, source)]
    steps = "; ".join(f"{i}) {r}" for i, r in enumerate(remedies, 1))
    return (f"the KV cache cannot hold one sequence of max_model_len={max_model_len} tokens: it needs "
            f"{needed / GiB:.3f} GiB ({needed} bytes) but {available / GiB:.3f} GiB ({available} bytes) "
            f"are available ({source}). Try, in this order: {steps}.")
