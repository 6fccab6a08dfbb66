"""TORCH: the reference paged-attention backend, plain torch on CPU and CUDA.

It is the oracle other backends are tested against, so it favours clarity; still, it
never loops over requests in Python for decodes: all decode rows of a step are one
batched gather + matmul, and each prefill chunk is one matmul over its gathered context.
KV cache layout: [2, num_blocks, block_size, num_kv_heads, head_size] (K then V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.contracts import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    BatchLayout,
    KV_CACHE_TORCH_DTYPES,
)


@dataclass
class TorchAttentionMetadata:
    layout: BatchLayout
    decode_rows: torch.Tensor  # token rows (== request index order) of pure-decode requests
    decode_reqs: torch.Tensor  # request indices of those rows
    decode_block_tables: torch.Tensor  # [num_decodes, blocks needed]
    decode_seq_lens: torch.Tensor  # [num_decodes]
    prefills: list[tuple[int, int, int, int]]  # (req index, token start, token end, seq_len)


class TorchMetadataBuilder(AttentionMetadataBuilder):
    def build(self, layout: BatchLayout) -> TorchAttentionMetadata:
        qsl = layout.query_start_loc_cpu.tolist()
        seq_lens = layout.seq_lens_cpu.tolist()
        decode_reqs, prefills = [], []
        for i, seq_len in enumerate(seq_lens):
            start, end = qsl[i], qsl[i + 1]
            if end - start == 1:
                decode_reqs.append(i)
            elif end > start:
                prefills.append((i, start, end, seq_len))
        device = layout.input_ids.device
        reqs = torch.tensor(decode_reqs, dtype=torch.long)
        rows = layout.query_start_loc_cpu[reqs].long() if decode_reqs else reqs
        dec_lens = layout.seq_lens_cpu[reqs] if decode_reqs else reqs
        max_blocks = int((dec_lens.max().item() + layout.block_size - 1) // layout.block_size) if decode_reqs else 0
        return TorchAttentionMetadata(
            layout=layout,
            decode_rows=rows.to(device),
            decode_reqs=reqs.to(device),
            decode_block_tables=layout.block_tables[reqs.to(device), :max_blocks].long(),
            decode_seq_lens=dec_lens.to(device),
            prefills=prefills,
        )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float, v_scale: float) -> None:
    """Store new keys/values at their slots (scaled down when the cache is FP8)."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_size)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_size)
    if kv_cache.dtype in KV_CACHE_TORCH_DTYPES.values():
        k = (k.float() / k_scale).to(kv_cache.dtype)
        v = (v.float() / v_scale).to(kv_cache.dtype)
    key_cache.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


class TorchAttentionImpl(AttentionImpl):
    def _read(self, cache: torch.Tensor, block_ids: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        x = cache[block_ids]  # [..., num_blocks, block_size, kvh, D]
        x = x.flatten(-4, -3) if x.dim() == 5 else x.flatten(0, 1)
        if cache.dtype in KV_CACHE_TORCH_DTYPES.values():
            return x.to(torch.float32).mul_(scale).to(dtype)
        return x

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, Q, H, D], k/v [B, K, KVH, D], mask [B, Q, K] (True = attend) -> [B, Q, H, D]."""
        b, nq, h, d = q.shape
        kvh = k.shape[2]
        group = h // kvh
        qg = q.reshape(b, nq, kvh, group, d).permute(0, 2, 3, 1, 4)  # [B, KVH, G, Q, D]
        kt = k.permute(0, 2, 3, 1).unsqueeze(2)  # [B, KVH, 1, D, K]
        scores = torch.matmul(qg.float(), kt.float()) * self.scale  # [B, KVH, G, Q, K]
        if self.logits_soft_cap:
            scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v.permute(0, 2, 1, 3).unsqueeze(2).float())  # [B, KVH, G, Q, D]
        return out.permute(0, 3, 1, 2, 4).reshape(b, nq, h, d).to(q.dtype)

    def _mask(self, q_pos: torch.Tensor, k_len: int, seq_lens: torch.Tensor) -> torch.Tensor:
        """q_pos [B, Q] absolute positions; keys 0..k_len-1 -> [B, Q, K]."""
        k_pos = torch.arange(k_len, device=q_pos.device)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
        if self.sliding_window:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
        return mask

    def forward(self, q, k, v, kv_cache, metadata: TorchAttentionMetadata):
        layout = metadata.layout
        write_kv(kv_cache, k, v, layout.slot_mapping, self.k_scale, self.v_scale)
        out = torch.empty_like(q)
        if metadata.decode_rows.numel():
            blocks = metadata.decode_block_tables
            keys = self._read(kv_cache[0], blocks, self.k_scale, q.dtype)
            values = self._read(kv_cache[1], blocks, self.v_scale, q.dtype)
            seq_lens = metadata.decode_seq_lens
            mask = self._mask((seq_lens - 1)[:, None], keys.shape[1], seq_lens)
            qd = q[metadata.decode_rows].unsqueeze(1)
            out[metadata.decode_rows] = self._attend(qd, keys, values, mask).squeeze(1)
        bs = layout.block_size
        for req, start, end, seq_len in metadata.prefills:
            blocks = layout.block_tables[req, : (seq_len + bs - 1) // bs].long()
            keys = self._read(kv_cache[0], blocks, self.k_scale, q.dtype)[None]
            values = self._read(kv_cache[1], blocks, self.v_scale, q.dtype)[None]
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[None]
            lens = torch.tensor([seq_len], device=q.device)
            mask = self._mask(q_pos, keys.shape[1], lens)
            out[start:end] = self._attend(q[start:end][None], keys, values, mask)[0]
        return out


class TorchBackend(AttentionBackend):
    name = "TORCH"
    priority = {"cpu": 100, "cuda": 0}
    supports_fp8_kv_cache = True

    @classmethod
    def check(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        return reasons

    @classmethod
    def kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def builder_cls(cls):
        return TorchMetadataBuilder

    @classmethod
    def impl_cls(cls):
        return TorchAttentionImpl
