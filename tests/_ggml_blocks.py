"""Random ggml blocks for kernel and format tests (test helper)."""

from __future__ import annotations

import torch

from pagedllm.plugins.quant.gguf_file import Q4_0, Q4_1, Q4_K, Q8_0, QK_K

BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


def random_blocks(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k/32 * block bytes] random ggml blocks whose fp16 scales (and Q4_1 mins) are finite
    (Q4_K: [n, k/256 * 144], random codes and 6-bit scales, d and dmin small enough that
    values stay of order 1)."""
    if qtype == Q4_K:
        raw = torch.randint(0, 256, (n * k // QK_K, 144), dtype=torch.uint8, generator=gen)
        raw[:, 0:4] = (torch.randn(raw.shape[0], 2, generator=gen) / 512).half().view(torch.uint8)
        return raw.reshape(n, -1)
    nb = n * k // 32
    raw = torch.randint(0, 256, (nb, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=gen)
    halves = torch.randn(nb, 2, generator=gen).half()
    raw[:, 0:2] = halves[:, 0:1].contiguous().view(torch.uint8)
    if qtype == Q4_1:
        raw[:, 2:4] = halves[:, 1:2].contiguous().view(torch.uint8)
    return raw.reshape(n, -1)


# --------------------------------------------------------------------------- K-quants
# Simple encoders (min/max per sub-block, no error search like llama.cpp's): tests need
# valid blocks that stay close to a model's weights, not the best ones.

def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.half().contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """float [n, k] (k a multiple of 256) -> Q4_K rows [n, k/256 * 144]: per 32-value
    sub-block w = d*sc*q - dmin*m, q in 0..15, sc and m 6-bit."""
    n, k = x.shape
    sb = x.float().reshape(-1, 8, 32)
    lo, hi = sb.amin(-1).clamp(max=0), sb.amax(-1)
    scale, mn = (hi - lo) / 15, -lo
    d = (scale.amax(-1, keepdim=True) / 63).half().float().clamp(min=2 ** -24)
    dmin = (mn.amax(-1, keepdim=True) / 63).half().float().clamp(min=2 ** -24)
    sc = torch.round(scale / d).clamp(0, 63).to(torch.uint8)
    m6 = torch.round(mn / dmin).clamp(0, 63).to(torch.uint8)
    step, offset = (d * sc.float()).clamp(min=1e-30), dmin * m6.float()
    q = torch.round((sb + offset.unsqueeze(-1)) / step.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    s0 = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s1 = (m6[:, :4] & 63) | ((m6[:, 4:] >> 4) << 6)
    s2 = (sc[:, 4:] & 15) | ((m6[:, 4:] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk i: sub-block 2i low, 2i + 1 high
    out = torch.cat((_f16_bytes(d), _f16_bytes(dmin), s0, s1, s2, qs), dim=1)
    return out.reshape(n, k // 256 * 144)


def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """float [n, k] (k a multiple of 256) -> Q6_K rows [n, k/256 * 210]: per 16-value
    sub-block w = d*sc*(q - 32), q in 0..63, sc int8."""
    n, k = x.shape
    sb = x.float().reshape(-1, 16, 16)
    scale = sb.abs().amax(-1) / 31
    d = (scale.amax(-1, keepdim=True) / 127).half().float().clamp(min=2 ** -24)
    sc = torch.round(scale / d).clamp(-128, 127)
    step = (d * sc).clamp(min=1e-30)
    q = (torch.round(sb / step.unsqueeze(-1)) + 32).clamp(0, 63).to(torch.uint8).reshape(-1, 2, 4, 32)  # (half, g, l)
    ql = torch.stack(((q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                      (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)), dim=2).reshape(-1, 128)
    high = (q >> 4) & 3
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    scales = sc.to(torch.int8).view(torch.uint8)
    out = torch.cat((ql, qh, scales, _f16_bytes(d)), dim=1)
    return out.reshape(n, k // 256 * 210)
