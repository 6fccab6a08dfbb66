"""FLASHINFER: FlashInfer's batch paged-KV wrappers, planned once per step and shared by all layers.

Cache layout is FlashInfer's own NHD paged cache, [num_blocks, 2, block_size,
num_kv_heads, head_size] (K then V inside each page), so the wrappers read it as is. Pages
are described in CSR form: request i owns pages `indices[indptr[i]:indptr[i+1]]`, the last
holding `last_page_len[i]` tokens; `paged_kv_arrays` builds them in plain torch (unit-tested
on the CPU). Decode requests (one query token) go to BatchDecodeWithPagedKVCacheWrapper,
the rest to BatchPrefillWithPagedKVCacheWrapper (causal, aligned to the end of each context).

Planning needs per-layer facts (softmax scale, window, soft-cap) that a builder does not
see; the builder plans for the model defaults (head_size**-0.5, no window, no cap) and a
layer with other values plans once per step for its own set (Gemma's alternating windows
plan twice per step, never once per layer). flashinfer imports only in the builder/impl.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.core.contracts import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    BatchLayout,
    KV_CACHE_TORCH_DTYPES,
    kv_cache_torch_dtype,
)

WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_SIZES = (64, 128, 256)
PlanKey = tuple[float, int, float]  # (softmax scale, window_left, logits soft-cap or 0)


@dataclass
class PagedKVArrays:
    """FlashInfer's CSR page table for a subset of a step's requests."""

    qo_indptr: torch.Tensor  # [n + 1] int32 (CPU): query rows of each request in the gathered q
    indptr: torch.Tensor  # [n + 1] int32 (CPU): page ranges into `indices`
    indices: torch.Tensor  # [total pages] int32 (on the block table's device)
    last_page_len: torch.Tensor  # [n] int32 (CPU), in 1..page_size
    rows: torch.Tensor  # [tokens] int64 (device): those requests' rows in the step's token stream


def paged_kv_arrays(layout: BatchLayout, req_ids: list[int]) -> PagedKVArrays:
    """The page table of requests `req_ids`, in that order (pure torch; the one device op is a gather).

    Index math happens on the CPU copies of the lengths, so building never syncs with the GPU.
    """
    block_size = layout.block_size
    reqs = torch.tensor(req_ids, dtype=torch.long)
    seq_lens = layout.seq_lens_cpu.long()[reqs]
    num_pages = (seq_lens + block_size - 1) // block_size
    indptr = torch.zeros(len(req_ids) + 1, dtype=torch.long)
    torch.cumsum(num_pages, 0, out=indptr[1:])
    # page j of the flattened list belongs to request owner[j], at column j - indptr[owner[j]]
    owner = torch.repeat_interleave(torch.arange(len(req_ids)), num_pages)
    column = torch.arange(int(indptr[-1])) - indptr[owner]
    device = layout.block_tables.device
    indices = layout.block_tables[reqs[owner].to(device), column.to(device)].to(torch.int32)

    starts = layout.query_start_loc_cpu.long()[reqs]
    query_lens = layout.query_lens_cpu.long()[reqs]
    qo_indptr = torch.zeros(len(req_ids) + 1, dtype=torch.long)
    torch.cumsum(query_lens, 0, out=qo_indptr[1:])
    rows = torch.repeat_interleave(starts - qo_indptr[:-1], query_lens) + torch.arange(int(qo_indptr[-1]))
    return PagedKVArrays(
        qo_indptr=qo_indptr.to(torch.int32), indptr=indptr.to(torch.int32), indices=indices,
        last_page_len=(seq_lens - (num_pages - 1) * block_size).to(torch.int32), rows=rows.to(device),
    )


@dataclass
class FlashInferMetadata:
    """One step: the page tables of its decode and prefill requests, and the wrappers planned on them."""

    slot_mapping: torch.Tensor
    num_tokens: int
    decode: PagedKVArrays | None
    prefill: PagedKVArrays | None
    builder: "FlashInferMetadataBuilder"
    plans: dict[PlanKey, tuple[Any, Any]] = field(default_factory=dict)  # key -> (decode, prefill) wrapper

    @property
    def is_single_group(self) -> bool:
        """True when all requests are decodes or all are prefills (no row gather needed)."""
        return self.decode is None or self.prefill is None

    def wrappers(self, key: PlanKey) -> tuple[Any, Any]:
        if key not in self.plans:
            self.plans[key] = self.builder.plan(self, key)
        return self.plans[key]


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[PlanKey, tuple[Any, Any]] = {}  # created once, re-planned every step
        self.default_key: PlanKey = (spec.head_size**-0.5, -1, 0.0)

    def build(self, layout: BatchLayout) -> FlashInferMetadata:
        query_lens = layout.query_lens_cpu.tolist()
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        prefills = [i for i, n in enumerate(query_lens) if n > 1]
        metadata = FlashInferMetadata(
            slot_mapping=layout.slot_mapping, num_tokens=layout.num_tokens,
            decode=paged_kv_arrays(layout, decodes) if decodes else None,
            prefill=paged_kv_arrays(layout, prefills) if prefills else None,
            builder=self,
        )
        metadata.wrappers(self.default_key)  # plan once, here, for the common case
        return metadata

    def _wrapper_pair(self, key: PlanKey) -> tuple[Any, Any]:
        import flashinfer

        if self._workspace is None:
            # one scratch buffer for every wrapper: they run one after another on one stream
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.spec.device)
        if key not in self._wrappers:
            group = self.spec.num_heads // self.spec.num_kv_heads
            self._wrappers[key] = (
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=group >= 4),
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD"),
            )
        return self._wrappers[key]

    def plan(self, metadata: FlashInferMetadata, key: PlanKey) -> tuple[Any, Any]:
        """Plan this step's wrappers for one (scale, window_left, soft-cap) set."""
        decode_wrapper, prefill_wrapper = self._wrapper_pair(key)
        spec = self.spec
        sm_scale, window_left, soft_cap = key
        options = dict(window_left=window_left, logits_soft_cap=soft_cap or None, sm_scale=sm_scale,
                       q_data_type=spec.dtype, kv_data_type=kv_cache_torch_dtype(spec.kv_cache_dtype, spec.dtype))
        heads = (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size)
        if metadata.decode is not None:
            d = metadata.decode
            decode_wrapper.plan(d.indptr, d.indices, d.last_page_len, *heads, pos_encoding_mode="NONE", **options)
        if metadata.prefill is not None:
            p = metadata.prefill
            prefill_wrapper.plan(p.qo_indptr, p.indptr, p.indices, p.last_page_len, *heads, causal=True, **options)
        return decode_wrapper, prefill_wrapper


def write_paged_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float, v_scale: float) -> None:
    """Store K/V at their slots in the [num_blocks, 2, block_size, heads, dim] cache (FP8: x / scale)."""
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if kv_cache.dtype in KV_CACHE_TORCH_DTYPES.values():
        # index_put has no float8 kernels; the bytes are the same through uint8 views
        key = (key.float() / k_scale).to(kv_cache.dtype).view(torch.uint8)
        value = (value.float() / v_scale).to(kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)


class FlashInferImpl(AttentionImpl):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: FlashInferMetadata) -> torch.Tensor:
        k_scale, v_scale = float(self.k_scale), float(self.v_scale)
        write_paged_kv(kv_cache, k, v, metadata.slot_mapping, k_scale, v_scale)
        window_left = self.sliding_window - 1 if self.sliding_window else -1
        decode_wrapper, prefill_wrapper = metadata.wrappers((self.scale, window_left, float(self.logits_soft_cap or 0.0)))
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        if metadata.is_single_group:
            wrapper = decode_wrapper if metadata.prefill is None else prefill_wrapper
            return wrapper.run(q, kv_cache, **scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for group, wrapper in ((metadata.decode, decode_wrapper), (metadata.prefill, prefill_wrapper)):
            out.index_copy_(0, group.rows, wrapper.run(q.index_select(0, group.rows), kv_cache, **scales))
        return out


class FlashInferBackend(AttentionBackend):
    name = "FLASHINFER"
    priority = {"cuda": 20}

    @classmethod
    def check(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if importlib.util.find_spec("flashinfer") is None:
            reasons.append("flashinfer is not installed (pip install pagedllm[flashinfer])")
        if spec.device.type != "cuda" or not torch.cuda.is_available():
            reasons.append("FlashInfer needs a CUDA GPU")
        elif torch.cuda.get_device_capability(spec.device) < (8, 0):
            reasons.append("FlashInfer needs compute capability >= 8.0 here (Ampere or newer)")
        if spec.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not supported (float16 or bfloat16)")
        if spec.head_size not in SUPPORTED_HEAD_SIZES:
            reasons.append(f"head size {spec.head_size} is not supported "
                           f"({', '.join(map(str, SUPPORTED_HEAD_SIZES))})")
        if spec.kv_cache_dtype != "auto" and spec.kv_cache_dtype not in KV_CACHE_TORCH_DTYPES:
            reasons.append(f"kv_cache_dtype {spec.kv_cache_dtype!r} is not one of auto, "
                           + ", ".join(KV_CACHE_TORCH_DTYPES))
        return reasons

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @classmethod
    def builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return FlashInferMetadataBuilder

    @classmethod
    def impl_cls(cls) -> type[AttentionImpl]:
        return FlashInferImpl
