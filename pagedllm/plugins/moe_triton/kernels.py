"""A Triton grouped GEMM for the routed experts, in the layout of vLLM's fused_moe.

The k (token, expert) pairs of each token are flattened (pair p = token * k + slot),
grouped by expert and padded per expert to a multiple of BLOCK_M (`align_pairs`, done in
torch without host syncs; padding slots hold the sentinel T * k and are masked). Expert e's block of pairs
then sits in BLOCK_M rows that all use one weight matrix, so one program per
(M block, N block) computes rows[pairs] @ W[e]^T over K in float32 tiles:

    pass 1: x[pair // k] @ w13[e]^T -> h [T * k, 2I]     (A rows are tokens)
    act(gate) * up in torch -> [T * k, I]
    pass 2: h'[pair] @ w2[e]^T * topk_weight[pair] -> y [T * k, H]   (A rows are pairs)

and the k rows of each token are summed. An expert without tokens gets no block. Tokens
are processed in chunks of PAGEDLLM_FUSED_MOE_CHUNK_SIZE as the reference does.

This module needs triton; on the CPU it runs only under TRITON_INTERPRET=1 (tests), and
the OpImpl offering it (this package's __init__) runs it on CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.moe import activation_and_mul, chunk_size

BLOCK_M = 16  # pairs per program (tl.dot needs 16 rows); vLLM tunes 16-128 per shape
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _grouped_gemm(a_ptr, b_ptr, c_ptr, pair_ptr, expert_ptr, weight_ptr,
                  N, K, num_pairs, top_k,
                  stride_am, stride_be, stride_bn, stride_cm,
                  A_ROWS_ARE_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tl.load(pair_ptr + pid_m * BLOCK_M) >= num_pairs:  # past the last expert's run: sentinels only
        return
    pairs = tl.load(pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // top_k if A_ROWS_ARE_TOKENS else pairs
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + kk[None, :],
                    mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + expert * stride_be + rn[None, :] * stride_bn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N] = W[e]^T tile
        if IEEE:  # float32 operands: float32 products (tl.dot would use tf32 on a GPU)
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pairs, mask=valid, other=0.0)
        acc = acc * w[:, None]
    tl.store(c_ptr + pairs[:, None].to(tl.int64) * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (rn[None, :] < N))


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by expert, each expert's run padded to a multiple of `block_m` with
    the sentinel T * k; the expert of each block of `block_m` pairs) for topk_ids [T, k].

    Sizes depend on T, k and E only (room for the worst-case padding; blocks past the last
    run hold sentinels only and their programs return at once), and nothing waits for the
    device, so the step stays capturable in a CUDA graph."""
    flat = topk_ids.reshape(-1).long()
    num_pairs, device = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = torch.cumsum(padded, 0)  # where each expert's padded run ends
    first = torch.cumsum(counts, 0) - counts  # where each expert's pairs begin in `order`
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - first[sorted_experts]
    blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pairs[run_ends[sorted_experts] - padded[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(blocks, device=device) * block_m
    experts = torch.searchsorted(run_ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return pairs, experts


def _gemm(a: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, experts: torch.Tensor, num_pairs: int,
          top_k: int, weights: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("grouped GEMM operands need a contiguous last dim")
    out = torch.empty(num_pairs, n, dtype=out_dtype, device=a.device)
    grid = (experts.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm[grid](a, w, out, pairs, experts, weights if weights is not None else out,
                        n, k, num_pairs, top_k,
                        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                        A_ROWS_ARE_TOKENS=weights is None, MUL_WEIGHT=weights is not None,
                        IEEE=a.dtype == torch.float32,
                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """`ops.fused_moe` on the grouped GEMM (same signature and semantics; see the reference)."""
    t, top_k = topk_ids.shape
    out = torch.empty_like(x)
    step = chunk_size()
    w13, w2 = w13.contiguous(), w2.contiguous()
    for start in range(0, t, step):
        xs = x[start:start + step].contiguous()
        ids = topk_ids[start:start + step]
        num_pairs = ids.numel()
        pairs, experts = align_pairs(ids, w13.shape[0])
        h = _gemm(xs, w13, pairs, experts, num_pairs, top_k, None, x.dtype)
        h = activation_and_mul(h, activation).contiguous()
        weights = topk_weights[start:start + step].reshape(-1).float().contiguous()
        y = _gemm(h, w2, pairs, experts, num_pairs, top_k, weights, torch.float32)
        out[start:start + xs.shape[0]] = y.view(xs.shape[0], top_k, -1).sum(dim=1).to(x.dtype)
    return out
