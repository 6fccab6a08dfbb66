"""A Triton dequant-GEMM for grouped integer weights (AWQ, GPTQ, compressed-tensors W4A16 /
W8A16 on a GPU): y = x @ W^T with W = scale * (q - zero), dequantized tile by tile in
registers, never as a whole matrix. The same kernel reads 4-bit codebook weights
(bitsandbytes NF4 / FP4): W = codebook[q] * absmax, a block's absmax in the scale's place.

Layout (`pack`): codes packed along the input dim into int32 words, `per_word = 32 / bits`
rows per word (GPTQ's own qweight layout, [K / per_word, N]); scales and zeros as
[groups, N] in the activation dtype's float. A program computes a [BLOCK_M, BLOCK_N] tile
of y; each BLOCK_K step loads the words for its rows, shifts the codes out, applies the
group's scale and zero (BLOCK_K divides the group size, so a step sees one group), and
accumulates `tl.dot` in float32 (`dot_tile`: float32 activations multiply in float32, 16-bit
ones on the tensor cores with the tile rounded to their dtype, as transformers multiplies a
16-bit model's dequantized weights). Act-order layers permute x's columns before the call.

This module needs triton; on the CPU it runs only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def x_tile(x_ptr, rm, kk, M, K, stride_xm):
    """Rows rm, columns kk of x [M, K] (row stride stride_xm), zeros outside it."""
    return tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                   other=0.0)


@triton.jit
def dot_tile(x, w):
    """x @ w with float32 sums. float32 x: float32 products (tl.dot would round both to tf32
    on a GPU: measured on an H200, 1e-2 off a 128-wide product); 16-bit x: w rounded to x's
    dtype, the tensor cores' products."""
    if x.dtype == tl.float32:
        return tl.dot(x, w.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(x, w.to(x.dtype))


@triton.jit
def _int_gemm(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, GROUP,
              stride_xm, stride_wk, stride_sg, stride_ym,
              BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              LUT: tl.constexpr = False):
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = x_tile(x_ptr, rm, kk, M, K, stride_xm)
        words = tl.load(w_ptr + (kk // PER_WORD)[:, None] * stride_wk + rn[None, :],
                        mask=(kk[:, None] < K) & (rn[None, :] < N), other=0)
        codes = (words >> ((kk % PER_WORD) * BITS)[:, None]) & MASK
        g = k0 // GROUP
        scale = tl.load(s_ptr + g * stride_sg + rn, mask=rn < N, other=0.0)
        if LUT:  # z_ptr: the codebook, one float32 value per code (bitsandbytes NF4 / FP4)
            w = tl.load(z_ptr + codes) * scale[None, :].to(tl.float32)
        else:
            zero = tl.load(z_ptr + g * stride_sg + rn, mask=rn < N, other=0.0)
            w = (codes.to(tl.float32) - zero[None, :].to(tl.float32)) * scale[None, :].to(tl.float32)
        acc += dot_tile(x, w)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] (uint8) -> int32 words [K / per_word, N], row k of a word at bits
    [bits * (k % per_word), ...)."""
    per_word = 32 // bits
    n, k = codes.shape
    q = codes.t().to(torch.int64).reshape(k // per_word, per_word, n)
    shifts = (torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits).view(1, per_word, 1)
    words = (q << shifts).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def block_k(group: int, what: str = "group size") -> int:
    """The K step: at most 64, dividing the group size (a step stays in one group; also
    triton_fp8's scale blocks, `what` naming the width in the error)."""
    for size in (64, 32, 16):
        if group % size == 0:
            return size
    raise ValueError(f"{what} {group} is not a multiple of 16")


BLOCK_N = 64  # output columns per program


def launch(m: int, n: int) -> tuple[int, tuple[int, int]]:
    """(BLOCK_M, grid) for an [m, n] output: row tiles of 16, 32 or 64 by the row count,
    BLOCK_N columns each (triton_fp8's GEMM launches alike)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))


def operand(x: torch.Tensor) -> torch.Tensor:
    """x as these kernels take it: contiguous, in its own 16-bit dtype (tensor-core
    products) or else float32."""
    return (x if x.dtype in (torch.float16, torch.bfloat16) else x.float()).contiguous()


def linear(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
           bits: int, codebook: bool = False) -> torch.Tensor:
    """x [M, K] (float32, or 16-bit for tensor-core products) @ W^T -> [M, N] float32,
    W = scale * (q - zero) per group, or with
    `codebook` W = zeros[q] * scale (`zeros` then being the float32 value of each code:
    bitsandbytes' NF4 / FP4 quant_map, `scales` the blocks' absmax)."""
    m, k = x.shape
    n = words.shape[1]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m, grid = launch(m, n)
    _int_gemm[grid](x, words, scales, zeros, y, m, n, k, group, x.stride(0), words.stride(0), scales.stride(0),
                    y.stride(0), BITS=bits, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k(group), LUT=codebook)
    return y
