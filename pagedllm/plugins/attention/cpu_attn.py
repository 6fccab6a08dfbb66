"""CPU_ATTN: paged attention on the CPU with the native kernel (no KV gather).

The TORCH reference gathers whole blocks of every request into a padded tensor each
layer, then runs SDPA: on a CPU, that copy is as expensive as the attention itself.
Here the C kernel (ops/cpu/csrc) walks each request's block table and reads keys
and values in place, for decodes and for prefill chunks: of any length where it
attends them 16 rows at a time (AVX-512 builds, head sizes of 16s), else up to
`NATIVE_MAX_QUERY_LEN` tokens, longer chunks going through the reference path, where
torch's fused SDPA then wins.
Same cache layout as TORCH: [2, num_blocks, block_size, num_kv_heads, head_size].
The kernels compute in float32. The cache is bf16 where that is exact (a bf16 model) or
allowed (a float32 model under "medium" matmul precision, core/precision.py: the GGUF
default) and the kernels have their bf16 path (AVX-512 CPUs with native bf16): a decode
step's attention is bound by the bytes of cache it reads, and bf16 halves them (and
doubles the tokens a cache budget holds). Elsewhere the cache is float32, for bf16
models too (`kv_cache_dtype`). q, k and v of a bf16 model are widened on the way in and
the output rounded back, two conversions per layer instead of TORCH's per-layer gather of
every block. No FP8 cache and no float16: `check()` refuses them, so auto-selection falls
back to TORCH.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.contracts import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionSpec,
    BatchLayout,
    GraphSupport,
)
from pagedllm.plugins.attention.torch_ref import AttentionGroup, TorchAttentionImpl, _group
from pagedllm.ops.cpu import features, native

# Where the kernel attends row at a time (no prefill tiles for this head size, or a build
# without the 512-bit path), query chunks longer than this go through torch's SDPA (see the
# module doc). Measured on a 2-core Zen 5, one causal prompt (9 query / 3 kv heads of 64,
# per layer): the row path took 0.6 / 3.3 / 8.8 / 35.8 ms at 256 / 620 / 1024 / 2048 tokens
# over a bf16 cache (3.3 / 11.2 / 48.3 ms from 620 over a float32 one) where SDPA took
# 1.2 / 6.2 / 13.6 / 45.3. With tiles (`native.attention_tiles`) every chunk stays native:
# 1.6 / 4.9 / 17.8 / 66.6 ms at 620 / 1024 / 2048 / 4096 tokens where SDPA took
# - / 13.8 / 48.8 / 146.7 (SDPA alone, without the reference path's gather).
NATIVE_MAX_QUERY_LEN = 1024
# Block tables are padded to a multiple of this many blocks, so their shape (part of a
# recorded step's key, see plugins/cpu_native/replay.py) changes once per 512 tokens, not 16.
BLOCK_TABLE_WIDTH_STEP = 32


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    # requests the native kernel serves (see native.paged_attention)
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    row_start: torch.Tensor
    long_groups: list[AttentionGroup]  # prefill chunks for the reference path

    @property
    def num_native(self) -> int:
        return self.seq_lens.shape[0]


class CpuMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        # the longest chunk the native kernel takes; a layer with a soft cap (Gemma 2) attends
        # row at a time even where tiles exist: still correct, slower than SDPA past 1024
        tiles = native.attention_tiles(spec.head_size, spec.num_heads // spec.num_kv_heads)
        self.max_native = None if tiles else NATIVE_MAX_QUERY_LEN

    def build(self, layout: BatchLayout) -> CpuAttentionMetadata:
        q_lens = layout.query_lens_cpu
        qsl = layout.query_start_loc_cpu
        limit = self.max_native
        long = [] if limit is None else (q_lens > limit).nonzero().flatten().tolist()
        if not long:
            reqs = slice(None)
            native_lens = q_lens
        else:
            keep = (q_lens <= limit) & (q_lens > 0)
            reqs = keep.nonzero().flatten()
            native_lens = q_lens[reqs]
        query_start = torch.zeros(native_lens.shape[0] + 1, dtype=torch.int32)
        torch.cumsum(native_lens, 0, out=query_start[1:])
        groups = [_group(layout, [i], slice(int(qsl[i]), int(qsl[i + 1])), int(q_lens[i])) for i in long]
        tables = layout.block_tables[reqs]
        width = -(-tables.shape[1] // BLOCK_TABLE_WIDTH_STEP) * BLOCK_TABLE_WIDTH_STEP
        padded = torch.zeros(tables.shape[0], width, dtype=torch.int32)
        padded[:, :tables.shape[1]] = tables
        return CpuAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            block_tables=padded,
            seq_lens=layout.seq_lens_cpu[reqs].to(torch.int32).contiguous(),
            query_start=query_start,
            row_start=qsl[:-1][reqs].to(torch.int32).contiguous(),
            long_groups=groups,
        )


class CpuAttentionImpl(TorchAttentionImpl):
    def forward(self, q, k, v, kv_cache, metadata: CpuAttentionMetadata):
        dtype = q.dtype
        if dtype != torch.float32:  # a bf16 model: the kernels take float32 q, k and v
            return self.forward(q.float(), k.float(), v.float(), kv_cache, metadata).to(dtype)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        native.write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)
        if metadata.num_native:
            native.paged_attention(q, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                                   metadata.query_start, metadata.row_start, out, self.scale,
                                   self.sliding_window or 0, self.logits_soft_cap or 0.0)
        if metadata.long_groups:
            out = self.attend_groups(q, kv_cache, metadata.long_groups, out)
        return out


class CpuAttnBackend(AttentionBackend):
    name = "CPU_ATTN"
    priority = {"cpu": 200}  # above TORCH (100) on the CPU whenever it can run
    # every kernel is native and the metadata's shapes depend only on the batch shape
    # (block tables padded, see BLOCK_TABLE_WIDTH_STEP): decode steps can be replayed
    graph_support = GraphSupport.DECODE
    # every query up to NATIVE_MAX_QUERY_LEN goes to the native kernel (no per-request group)
    graph_max_query_len = NATIVE_MAX_QUERY_LEN

    @classmethod
    def check(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.device.type != "cpu":
            reasons.append("runs on the CPU only")
        if spec.dtype not in (torch.float32, torch.bfloat16):
            reasons.append(f"dtype {spec.dtype} (float32 and bfloat16 only; use TORCH)")
        if spec.kv_cache_dtype != "auto":
            reasons.append(f"kv_cache_dtype {spec.kv_cache_dtype} (a float32 or bf16 cache only; use TORCH for FP8)")
        if not reasons and not native.available():
            reasons.append("native CPU kernels unavailable (no C compiler, or PAGEDLLM_CPU_KERNELS=0)")
        return reasons

    @classmethod
    def kv_cache_dtype(cls, spec: AttentionSpec) -> torch.dtype:
        """bf16 where it is exact (a bf16 model) or allowed ("medium" precision) and the
        kernels have the bf16 path (AVX-512, head size a multiple of 16, a CPU with native
        bf16 so the GEMMs around it are bf16 too); float32 otherwise (check() refuses FP8)."""
        allowed = spec.dtype == torch.bfloat16 or (spec.dtype == torch.float32 and spec.matmul_precision == "medium")
        if allowed and spec.head_size % 16 == 0 and features.detect().native_bf16 and native.bf16_kv_available():
            return torch.bfloat16
        return torch.float32

    @classmethod
    def builder_cls(cls):
        return CpuMetadataBuilder

    @classmethod
    def impl_cls(cls):
        return CpuAttentionImpl
