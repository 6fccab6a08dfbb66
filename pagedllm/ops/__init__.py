"""The layer ops: what model layers call for work that has faster kernels than plain torch.

Each op below is defined by its plain-torch reference (the docstring is the contract an
implementation must meet) and dispatches through `dispatch.Op`: on first use per
(device type, dtype) it picks the highest-priority implementation a plugin offers
through the `pagedllm_op_impls` hook that can run there (the built-in native CPU kernels
are one such plugin, `plugins/cpu_native`), else the reference. Attention has its own
plugin kind (attention backends) and quantized matmuls belong to their LinearMethod.

`pagedllm.ops.cpu` is the native CPU kernel library those implementations call.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from pagedllm.ops.dispatch import Op, chosen, reset
from pagedllm.ops.moe import PackedExperts, fused_moe, pack_moe, select_experts
from pagedllm.core.precision import dense_weight_dtype, float32_matmul_precision, matmul_precision

__all__ = ["Op", "PackedExperts", "PackedLinear", "chosen", "dense_weight_dtype", "float32_matmul_precision", "fused_moe",
           "gather_rows", "matmul_precision",
           "gelu_and_mul", "pack_linear", "pack_moe", "reset", "rms_norm", "rotary_qkv", "select_experts", "silu_and_mul"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalise x [..., H] in float32 and scale by `weight` (float32 [H], contiguous).

    Without `residual`: returns norm(x) * weight in x's dtype. With `residual` (x's
    shape): returns (norm(x + residual) * weight, x + residual); an implementation may
    compute the sum in place in `residual`, so callers must use the returned tensor and
    never share `residual` with anything else.
    """
    if residual is not None:
        x = x + residual
        residual = x
    out = F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
    return out if residual is None else (out, residual)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim (the fused gate_up output)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for x = [gate | up] along the last dim: the GeGLU
    of Gemma's MLP (transformers' "gelu_pytorch_tanh")."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rotary_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused qkv output [T, (H + 2 KVH) D] into q [T, H, D], k and v [T, KVH, D],
    with q and k rotated neox-style (rotate halves, as Hugging Face Llama does) in float32.

    cos, sin: float32 [T, D/2] for each token's position. An implementation may rotate in
    place inside `qkv` and return views of it.
    """
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    qk = torch.cat((q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim)), dim=1)
    half = head_dim // 2
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    xf = qk.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    qk = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qkv.dtype)
    return qk[:, :num_heads], qk[:, num_heads:], v.reshape(t, num_kv_heads, head_dim)


def _gather_rows(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """table[ids] for a table [rows, ...] and 1-D int64 ids [n] -> [n, ...] in `dtype`, by
    default the table's (embedding and rotary-table lookups; a bf16 embedding kept under
    float32 compute asks for float32 rows)."""
    rows = table[ids]
    return rows if dtype is None else rows.to(dtype)


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index of x [rows, cols] -> int64 [rows] (greedy sampling);
    a NaN counts as the maximum, as in torch's max."""
    return x.max(dim=-1).indices


class PackedLinear(Protocol):
    """What `pack_linear` returns: the weight in a kernel's layout, applied by calling it."""

    # True when it holds its own copy of the weight, so the layer may drop the plain one
    owns_copy: bool
    # names the layout and product dtype (logs, crossover cache keys), e.g. "f32", "amx-bf16"
    kind: str
    # bytes of weight one call reads (the smaller layout where it holds two): how many
    # copies a crossover timing streams through (pagedllm/ops/cpu/crossover.py)
    nbytes: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype."""

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`silu_and_mul(self(x, bias))` (a gate/up weight: [gate | up]) in one pass, where the
        kernel fuses the activation into the product for this batch; None where it does
        not (the caller then runs the two). A fused result equals the two run apart."""


class _TorchLinear:
    kind = "torch"

    def __init__(self, weight: torch.Tensor) -> None:
        # a 16-bit weight kept under float32 compute (`dense_weight_dtype()`) is widened
        # once: F.linear wants both operands in one dtype
        self.owns_copy = dense_weight_dtype() is not None and weight.dtype != torch.float32
        self.weight = weight.float() if self.owns_copy else weight
        self.nbytes = self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> None:
        return None


def _pack_linear(weight: torch.Tensor) -> PackedLinear:
    """Prepare a dense weight [N, K] once, after loading, for repeated x @ W^T: returns a
    `PackedLinear` (the reference keeps the weight as it is, or widened to float32 for
    float32 compute, and calls F.linear).

    For a float32 weight, products must be float32 unless `float32_matmul_precision()` is
    "medium" at pack time (see pagedllm/core/precision.py); then bf16 products are allowed.
    A bf16 weight may meet float32 activations (`dense_weight_dtype()` set at pack time):
    the result is in x's dtype either way."""
    return _TorchLinear(weight)


rms_norm: Op = Op("rms_norm", _rms_norm)
silu_and_mul: Op = Op("silu_and_mul", _silu_and_mul)
gelu_and_mul: Op = Op("gelu_and_mul", _gelu_and_mul)
rotary_qkv: Op = Op("rotary_qkv", _rotary_qkv)
gather_rows: Op = Op("gather_rows", _gather_rows)
argmax_rows: Op = Op("argmax_rows", _argmax_rows)
pack_linear: Op = Op("pack_linear", _pack_linear)
