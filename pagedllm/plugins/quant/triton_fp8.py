"""A Triton GEMM for block-scaled FP8 weights (DeepSeek-V3's `weight_block_size`, e.g.
[128, 128], `weight_scale_inv`) on a GPU: y = x @ W^T with W = code * scale[n // bn, k // bk],
decoded tile by tile in registers, so the weight stays 1 byte per value (a dequantized
bf16 copy would take twice the memory).

The codes are read as bytes and decoded from their e4m3fn bits (sign, 4 exponent bits of
bias 7, 3 mantissa bits; exact in float32), which also lets the kernel run under
TRITON_INTERPRET=1 on the CPU, where numpy has no float8 type. A program computes a
[BLOCK_M, BLOCK_N] tile of y; each BLOCK_K step (dividing bk, so a step sees one scale
column) loads a [BLOCK_K, BLOCK_N] tile of codes and the scales of its rows' blocks, and
accumulates `tl.dot` in float32 (triton_int.dot_tile). Activations arrive in float32 or the
model's 16-bit dtype (the W8A8 per-token-group rounding, where asked, is applied before
the call).

This module needs triton; on the CPU it runs only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.plugins.quant.triton_int import BLOCK_N, block_k, dot_tile, launch, x_tile


@triton.jit
def _fp8_block_gemm(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, BN_SCALE, BK_SCALE,
                    stride_xm, stride_wn, stride_sn, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = x_tile(x_ptr, rm, kk, M, K, stride_xm)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0).to(tl.int32)
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        # e4m3fn: (1 + m/8) * 2^(e - 7) = (8 + m) * 2^(e - 10); subnormal (e = 0): m * 2^-9
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
        w = tl.where((b >> 7) == 1, -mag, mag)
        scale = tl.load(s_ptr + (rn // BN_SCALE) * stride_sn + k0 // BK_SCALE, mask=rn < N, other=0.0)
        acc += dot_tile(x, w * scale[None, :])
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] (float32, or 16-bit: see triton_int.dot_tile) @ W^T -> [M, N] float32, for
    codes float8_e4m3fn (or their uint8 view) [N, K] and float32 scales
    [ceil(N / bn), ceil(K / bk)]."""
    m, k = x.shape
    n = codes.shape[0]
    raw = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m, grid = launch(m, n)
    _fp8_block_gemm[grid](x, raw, scales, y, m, n, k, block[0], block[1], x.stride(0), raw.stride(0),
                          scales.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                          BLOCK_K=block_k(block[1], "FP8 weight block width"))
    return y
