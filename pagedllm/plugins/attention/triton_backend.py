"""TRITON: our own Triton kernels over the paged KV cache (see triton_kernels.py).

Same cache layout as TORCH ([2, num_blocks, block_size, num_kv_heads, head_size]) so the
two are interchangeable. Each step's requests split into decodes (one query token: the
split-context decode kernel) and prefill chunks (the varlen causal kernel); the builder
does that split once per step on the CPU copies, so `forward` never syncs.

Sliding windows and chunked local attention (Llama 4) only move each query's first
visible key, so both run in the same kernels.

An "mla" spec (one latent per token, see KVCacheSpec) keeps a [num_blocks, block_size,
latent_size] cache, seen by the kernels as one kv head whose keys are the whole latent
and whose values are its first `value_size` elements (`value_is_key`).

Importing this module needs no triton: the kernels load on the first `forward`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from pagedllm.core.contracts import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    BatchLayout,
    KV_CACHE_TORCH_DTYPES,
)

_KERNELS_MODULE = "pagedllm.plugins.attention.triton_kernels"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_SIZE, MAX_HEAD_SIZE = 16, 256
# MLA: the value part of the latent and the key's tail beyond it each get their own tile
MAX_MLA_VALUE_SIZE, MAX_MLA_TAIL = 512, 256


def load_kernels() -> ModuleType:
    """The kernel module, imported on first use (it needs triton)."""
    return importlib.import_module(_KERNELS_MODULE)


def _interpreter_reason() -> str | None:
    """Why CPU tensors cannot run here, if they cannot.

    Triton decides compiled vs interpreted when `@triton.jit` runs, and its own library
    (tl.sum, tl.max, ...) is jitted when triton is imported: the interpreter works only if
    TRITON_INTERPRET=1 was set before the first `import triton` of the process.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return ("there is no GPU: Triton kernels run on the CPU only interpreted, with TRITON_INTERPRET=1 "
                "(slow; meant for tests)")
    triton = sys.modules.get("triton")
    library_sum = getattr(getattr(getattr(triton, "language", None), "standard", None), "sum", None)
    if library_sum is not None:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(library_sum, InterpretedFunction):
            return ("triton was imported before TRITON_INTERPRET=1 was set; set it before Python starts "
                    "(or before anything imports triton)")
    return None


@dataclass
class TritonAttentionMetadata:
    """One step's batch, split for the two attention kernels (device tensors are int32)."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    decode_req_ids: torch.Tensor  # requests with exactly one query token
    prefill_req_ids: torch.Tensor  # requests with more (prefill chunks, spec-decode verification)
    max_prefill_query_len: int
    max_decode_seq_len: int
    target_decode_programs: int  # how many programs fill this device (sets the decode partition size)


def split_decodes(layout: BatchLayout) -> tuple[list[int], list[int]]:
    """Request indices with one query token, and those with more (empty requests are dropped)."""
    query_lens = layout.query_lens_cpu.tolist()
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    prefills = [i for i, n in enumerate(query_lens) if n > 1]
    return decodes, prefills


class TritonMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        if spec.device.type == "cuda" and torch.cuda.is_available():
            # two waves of programs per SM hide the merge pass's cost behind a full GPU
            self.target_decode_programs = 2 * torch.cuda.get_device_properties(spec.device).multi_processor_count
        else:
            self.target_decode_programs = 8

    def build(self, layout: BatchLayout) -> TritonAttentionMetadata:
        decodes, prefills = split_decodes(layout)
        device = layout.seq_lens.device
        seq_lens_cpu, query_lens_cpu = layout.seq_lens_cpu, layout.query_lens_cpu
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            block_tables=layout.block_tables.to(torch.int32),
            query_start_loc=layout.query_start_loc.to(torch.int32),
            seq_lens=layout.seq_lens.to(torch.int32),
            decode_req_ids=torch.tensor(decodes, dtype=torch.int32).to(device),
            prefill_req_ids=torch.tensor(prefills, dtype=torch.int32).to(device),
            max_prefill_query_len=max((int(query_lens_cpu[i]) for i in prefills), default=0),
            max_decode_seq_len=max((int(seq_lens_cpu[i]) for i in decodes), default=0),
            target_decode_programs=self.target_decode_programs,
        )


class TritonAttentionImpl(AttentionImpl):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonAttentionMetadata) -> torch.Tensor:
        kernels = load_kernels()
        mla = self.spec.kind == "mla"
        if mla:  # the latent cache as one kv head; values are the latents' first value_size elements
            key_cache = value_cache = kv_cache.unsqueeze(2)
            k_scale = v_scale = float(self.k_scale)
            kernels.write_kv(key_cache, None, k, None, metadata.slot_mapping, k_scale, v_scale)
        else:
            key_cache, value_cache = kv_cache[0], kv_cache[1]
            k_scale, v_scale = float(self.k_scale), float(self.v_scale)
            kernels.write_kv(key_cache, value_cache, k, v, metadata.slot_mapping, k_scale, v_scale)
        out = torch.empty((q.shape[0], q.shape[1], self.spec.out_head_size), dtype=q.dtype, device=q.device)
        common = dict(
            key_cache=key_cache, value_cache=value_cache, block_tables=metadata.block_tables,
            query_start_loc=metadata.query_start_loc, seq_lens=metadata.seq_lens, scale=self.scale,
            k_scale=k_scale, v_scale=v_scale, window=self.sliding_window, soft_cap=self.logits_soft_cap,
            value_is_key=mla, attention_chunk_size=self.attention_chunk_size,
        )
        if metadata.max_prefill_query_len:
            kernels.prefill_attention(out, q, req_ids=metadata.prefill_req_ids,
                                      max_query_len=metadata.max_prefill_query_len, **common)
        if metadata.max_decode_seq_len:
            # a decode sees at most its window's and its chunk's keys: that many set the partitions
            max_context = min(metadata.max_decode_seq_len, self.sliding_window or metadata.max_decode_seq_len,
                              self.attention_chunk_size or metadata.max_decode_seq_len)
            partition_size = kernels.decode_partition_size(
                metadata.decode_req_ids.shape[0], key_cache.shape[2], max_context, metadata.target_decode_programs)
            kernels.decode_attention(out, q, req_ids=metadata.decode_req_ids, max_context=max_context,
                                     partition_size=partition_size, **common)
        return out


def _fp8_reason(spec: AttentionSpec) -> str | None:
    if spec.kv_cache_dtype == "auto":
        return None
    if spec.kv_cache_dtype not in KV_CACHE_TORCH_DTYPES:
        return f"kv_cache_dtype {spec.kv_cache_dtype!r} is not one of auto, {', '.join(KV_CACHE_TORCH_DTYPES)}"
    if spec.device.type == "cuda" and torch.cuda.is_available():
        if torch.cuda.get_device_capability(spec.device) < (8, 9):
            return "an FP8 KV cache needs a GPU with compute capability >= 8.9 (Ada, Hopper or newer) for Triton"
    return None


class TritonBackend(AttentionBackend):
    name = "TRITON"
    # On the CPU it only runs interpreted (tests); it must never win over TORCH there.
    priority = {"cuda": 10, "cpu": 1}
    kinds = frozenset({"mha", "mla"})
    supports_attention_chunks = True  # the kernels bound each query's keys by its chunk start too

    @classmethod
    def check(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("triton is not installed (pip install pagedllm[triton])")
        device = spec.device.type
        if device == "cuda":
            if not torch.cuda.is_available():
                reasons.append("CUDA is not available")
        elif device == "cpu":
            interpreter = _interpreter_reason()
            if interpreter:
                reasons.append(interpreter)
        else:
            reasons.append(f"device {device!r} is not supported (cuda, or cpu with TRITON_INTERPRET=1)")
        if spec.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not supported (float16, bfloat16, float32)")
        if spec.kind == "mla":
            value, tail = spec.out_head_size, spec.head_size - spec.out_head_size
            if not MIN_HEAD_SIZE <= value <= MAX_MLA_VALUE_SIZE or tail > MAX_MLA_TAIL:
                reasons.append(f"MLA latent of {spec.head_size} ({value} value + {tail}) is not supported "
                               f"(value {MIN_HEAD_SIZE}..{MAX_MLA_VALUE_SIZE}, rest up to {MAX_MLA_TAIL})")
        elif not MIN_HEAD_SIZE <= spec.head_size <= MAX_HEAD_SIZE:
            reasons.append(f"head size {spec.head_size} is not supported ({MIN_HEAD_SIZE}..{MAX_HEAD_SIZE})")
        fp8 = _fp8_reason(spec)
        if fp8:
            reasons.append(fp8)
        return reasons

    @classmethod
    def builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return TritonMetadataBuilder

    @classmethod
    def impl_cls(cls) -> type[AttentionImpl]:
        return TritonAttentionImpl
