"""FLASH_ATTN: FlashAttention-2 (the `flash-attn` package) over the paged KV cache.

Cache layout is TORCH's [2, num_blocks, block_size, num_kv_heads, head_size], so
`kv_cache[0]` / `kv_cache[1]` are exactly flash-attn's paged `k_cache` / `v_cache`
([num_blocks, page_block_size, nheads_k, headdim]) with no copy. Mixed and prefill steps
go through `flash_attn_varlen_func(..., block_table=...)`; pure-decode steps through
`flash_attn_with_kvcache`, which splits long contexts itself.

flash-attn 2 accepts a paged cache only when the page (our block) size is a multiple of
256 (`Paged KV cache block size must be divisible by 256`), so `check()` refuses other
block sizes with the size to use instead of ever running on a layout it would misread.
flash-attn imports only inside `forward` (and its presence is probed, not imported, by
`check`), so this module loads on any machine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

import torch

from pagedllm.core.contracts import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    BatchLayout,
)

PAGE_SIZE_MULTIPLE = 256
MIN_VERSION = (2, 6)  # block_table in the varlen API and softcap
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class FlashAttnMetadata:
    """flash-attn's view of one step (device tensors int32)."""

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1]
    cu_seqlens_k: torch.Tensor  # [num_reqs + 1]: cumulative context lengths (cached + new)
    seq_lens: torch.Tensor  # [num_reqs]
    block_table: torch.Tensor  # [num_reqs, blocks for the longest context]
    max_query_len: int
    max_seq_len: int
    is_pure_decode: bool


def build_flash_attn_metadata(layout: BatchLayout) -> FlashAttnMetadata:
    """Pure torch (no flash-attn needed): cumulative lengths from the CPU copies, then one copy each."""
    device = layout.seq_lens.device
    cu_seqlens_k = torch.zeros(layout.num_reqs + 1, dtype=torch.int32)
    torch.cumsum(layout.seq_lens_cpu, 0, out=cu_seqlens_k[1:])
    max_blocks = -(-layout.max_seq_len // layout.block_size)
    return FlashAttnMetadata(
        slot_mapping=layout.slot_mapping,
        cu_seqlens_q=layout.query_start_loc.to(torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(device),
        seq_lens=layout.seq_lens.to(torch.int32),
        block_table=layout.block_tables[:, :max_blocks].to(torch.int32),
        max_query_len=layout.max_query_len,
        max_seq_len=layout.max_seq_len,
        is_pure_decode=layout.is_pure_decode,
    )


class FlashAttnMetadataBuilder(AttentionMetadataBuilder):
    def build(self, layout: BatchLayout) -> FlashAttnMetadata:
        return build_flash_attn_metadata(layout)


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """Our window W (a query sees itself and the W-1 keys before it) as flash-attn's (left, right)."""
    return (sliding_window - 1, 0) if sliding_window else (-1, -1)


def write_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V at their slots (flash-attn has no such op; one index_copy_ each)."""
    num_kv_heads, head_size = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


class FlashAttnImpl(AttentionImpl):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: FlashAttnMetadata) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        key_cache, value_cache = kv_cache[0], kv_cache[1]
        write_kv_cache(key_cache, value_cache, k, v, metadata.slot_mapping)
        options = dict(softmax_scale=self.scale, causal=True, window_size=window_size(self.sliding_window),
                       softcap=float(self.logits_soft_cap or 0.0))
        if metadata.is_pure_decode:
            out = flash_attn_with_kvcache(q.unsqueeze(1), key_cache, value_cache, cache_seqlens=metadata.seq_lens,
                                          block_table=metadata.block_table, **options)
            return out.squeeze(1)
        return flash_attn_varlen_func(
            q, key_cache, value_cache, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
            metadata.max_query_len, metadata.max_seq_len, block_table=metadata.block_table, **options)


def _installed_version(dist: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class FlashAttnBackend(AttentionBackend):
    name = "FLASH_ATTN"
    priority = {"cuda": 30}

    @classmethod
    def check(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if importlib.util.find_spec("flash_attn") is None:
            reasons.append("flash_attn is not installed (pip install pagedllm[flash-attn])")
        else:
            version = _installed_version("flash-attn") or _installed_version("flash_attn")
            if version is not None and version < MIN_VERSION:
                reasons.append(f"flash-attn >= {'.'.join(map(str, MIN_VERSION))} is needed (paged varlen, softcap); "
                               f"found {'.'.join(map(str, version))}")
        if spec.kv_cache_dtype != "auto":
            reasons.append(f"kv_cache_dtype {spec.kv_cache_dtype}: this wrapper keeps the cache in the model dtype "
                           "(use TRITON or FLASHINFER for an FP8 cache)")
        if spec.device.type != "cuda" or not torch.cuda.is_available():
            reasons.append("FlashAttention needs a CUDA GPU")
        elif torch.cuda.get_device_capability(spec.device) < (8, 0):
            reasons.append("FlashAttention-2 needs compute capability >= 8.0 (Ampere or newer)")
        if spec.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not supported (float16 or bfloat16)")
        if spec.head_size % 8 or spec.head_size > 256:
            reasons.append(f"head size {spec.head_size} is not supported (a multiple of 8, at most 256)")
        if spec.kv_cache_dtype != "auto":
            reasons.append(f"FLASH_ATTN has no FP8 KV cache (kv_cache_dtype={spec.kv_cache_dtype!r}); use "
                           "kv_cache_dtype='auto', or FLASHINFER / TRITON for an FP8 cache")
        if spec.block_size % PAGE_SIZE_MULTIPLE:
            suggested = -(-spec.block_size // PAGE_SIZE_MULTIPLE) * PAGE_SIZE_MULTIPLE
            reasons.append(f"flash-attn 2 needs the paged-cache block size to be a multiple of {PAGE_SIZE_MULTIPLE} "
                           f"(got block_size={spec.block_size}); run with --block-size {suggested}")
        return reasons

    @classmethod
    def builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return FlashAttnMetadataBuilder

    @classmethod
    def impl_cls(cls) -> type[AttentionImpl]:
        return FlashAttnImpl
