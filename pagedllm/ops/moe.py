"""Mixture-of-experts ops: routing (`select_experts`) and the routed experts' SwiGLU MLP
(`fused_moe`).

`fused_moe` is an `Op`: its reference below is the contract (and what kernels such as
plugins/moe_triton's grouped GEMM are tested against). It never loops over tokens: the
(token, expert) pairs are sorted by expert once per chunk, each expert that received
tokens runs one GEMM pair on its rows, and the weighted rows are scatter-added back to
their tokens. `expert_rows` is that grouping on its own, for expert layouts other than
the dense one (a quantized MoE method dequantizes each expert inside `expert_fn`).

`pack_moe` prepares dense experts once after loading, as `pack_linear` does for a dense
weight: a kernel with its own expert layout (the native CPU one, plugins/cpu_native)
offers it; the reference keeps the tensors for `fused_moe`.

`select_experts` is plain torch (small [T, E] tensors): softmax top-k as Qwen-MoE and
Mixtral route, and DeepSeek-V3's grouped sigmoid routing with a selection-only bias.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from pagedllm.core import envs
from pagedllm.core.precision import dense_weight_dtype
from pagedllm.ops.dispatch import Op

DEFAULT_CHUNK_SIZE = 32768  # vLLM's VLLM_FUSED_MOE_CHUNK_SIZE default


def chunk_size() -> int:
    """Tokens per chunk of a MoE layer (PAGEDLLM_FUSED_MOE_CHUNK_SIZE / VLLM_FUSED_MOE_CHUNK_SIZE)."""
    raw = envs.get("PAGEDLLM_FUSED_MOE_CHUNK_SIZE")
    if raw is None:
        return DEFAULT_CHUNK_SIZE
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{envs.source('PAGEDLLM_FUSED_MOE_CHUNK_SIZE')}={raw!r}: expected a positive "
                         "number of tokens")
    return value


def activation_and_mul(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for h = [gate | up] along the last dim ("silu": SwiGLU; "gelu": tanh GeGLU)."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate, approximate="tanh") * up
    raise NotImplementedError(f"MoE activation {activation!r} is not supported (silu, gelu)")


def expert_rows(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_fn: Callable[[int, torch.Tensor], torch.Tensor], out_features: int | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_fn(topk_ids[t, j], x[t]) for every token t -> [T, out_features]
    (default x's last dim), with one `expert_fn(e, rows [n, H]) -> [n, out_features]` call per
    expert that received tokens, chunked by `chunk_size()` tokens. Sums are float32; the
    result has x's dtype. Pairs of weight 0 are not computed (they add nothing): under
    expert parallelism they are the pairs of another rank's experts."""
    t, k = topk_ids.shape
    out = torch.zeros(t, out_features or x.shape[-1], dtype=torch.float32, device=x.device)
    step = chunk_size()
    for start in range(0, t, step):
        pair_weights = topk_weights[start:start + step].reshape(-1).float()
        # zero-weight pairs go to a bucket past the last expert, which is never run
        flat = torch.where(pair_weights == 0, num_experts, topk_ids[start:start + step].reshape(-1))
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // k + start
        counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()  # one host sync per chunk
        pair_weights = pair_weights[order]
        begin = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = slice(begin, begin + n)
            begin += n
            rows = tokens[seg]
            out.index_add_(0, rows, expert_fn(e, x[rows]).float() * pair_weights[seg, None])
    return out.to(x.dtype)


def _fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The routed experts' gated MLP for x [T, H] -> [T, H] in x's dtype.

    w13: [E, 2I, H], each expert's gate rows then its up rows; w2: [E, H, I];
    topk_weights: float32 [T, k]; topk_ids: integer [T, k] in [0, E).
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))
    with e = topk_ids[t, j], act = silu ("silu") or tanh-gelu ("gelu"); products in the
    weights' dtype, the weighted sum over experts in float32. Tokens are processed in
    chunks of PAGEDLLM_FUSED_MOE_CHUNK_SIZE (alias VLLM_FUSED_MOE_CHUNK_SIZE).
    """
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(activation_and_mul(F.linear(rows, w13[e]), activation), w2[e])

    return expert_rows(x, topk_weights, topk_ids, w13.shape[0], expert)


fused_moe: Op = Op("fused_moe", _fused_moe)


class PackedExperts(Protocol):
    """What `pack_moe` returns: a layer's dense experts in a kernel's layout, applied by
    calling it with `fused_moe`'s routing arguments."""

    # True when it holds its own copy of the weights, so the layer may drop the plain ones
    owns_copy: bool
    kind: str  # names the layout (logs), e.g. "torch", "cpu-f32"

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 activation: str) -> torch.Tensor:
        """fused_moe(x, w13, w2, topk_weights, topk_ids, activation)."""


class _FusedExperts:
    kind = "torch"

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        # 16-bit experts kept under float32 compute (`dense_weight_dtype()`) are widened once
        self.owns_copy = dense_weight_dtype() is not None and w13.dtype != torch.float32
        self.w13, self.w2 = (w13.float(), w2.float()) if self.owns_copy else (w13, w2)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 activation: str) -> torch.Tensor:
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, activation)


def _pack_moe(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts:
    """Prepare a layer's dense experts (`fused_moe`'s w13 [E, 2I, H], w2 [E, H, I]) once,
    after loading: returns a `PackedExperts`. The reference keeps the tensors and calls
    `fused_moe` (so its own implementations, e.g. the Triton grouped GEMM, still apply)."""
    return _FusedExperts(w13, w2)


pack_moe: Op = Op("pack_moe", _pack_moe)


def select_experts(router_logits: torch.Tensor, top_k: int, *, renormalize: bool, scoring: str = "softmax",
                   num_expert_group: int | None = None, topk_group: int | None = None,
                   correction_bias: torch.Tensor | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights from router logits [T, E]: (float32 [T, k], int64 [T, k]).

    scoring "softmax" (Qwen2/3-MoE, Mixtral): probabilities over all experts, the top k,
    divided by their sum when `renormalize` (Qwen's norm_topk_prob).
    scoring "sigmoid" (DeepSeek-V3): per-expert sigmoid scores; `correction_bias` [E] is
    added for choosing only. With `num_expert_group`, experts form that many equal groups,
    ranked by the sum of their two best (biased) scores; the best `topk_group` groups are
    kept and the top k experts are chosen among them. Weights are the chosen experts'
    unbiased scores, divided by their sum (+1e-20) when `renormalize`.
    Either way the weights are finally multiplied by `routed_scaling_factor`.
    """
    logits = router_logits.float()
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"MoE scoring {scoring!r} is not one of softmax, sigmoid")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        t, e = choice.shape
        if e % num_expert_group or topk_group is None:
            raise ValueError(f"grouped routing needs topk_group and {e} experts divisible into "
                             f"{num_expert_group} groups")
        grouped = choice.view(t, num_expert_group, e // num_expert_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // num_expert_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        denom = weights.sum(dim=-1, keepdim=True)
        weights = weights / (denom + 1e-20 if scoring == "sigmoid" else denom)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids
