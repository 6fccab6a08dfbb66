"""Dense float32 linears on the CPU, with weights packed once at load.

`F.linear` hands MKL the plain [N, K] weight on every call, which repacks it into its
blocked layout each time: at decode batch sizes (8-64 rows) that costs as much as the
multiply (measured on SmolLM2's shapes, AVX2, 2 threads: 1.3-2.4x faster packed at
9-64 rows, the 49152-row lm_head 1.9x at 64 rows; equal at 4096 rows).

Two packed kernels, best first: the native GEMM (csrc/sgemm.c, pd_sgemm) where
the kernels are built, else oneDNN's packed-weight linear that torch ships (the kernels
its inductor uses). MKL and oneDNN are tuned for Intel cores: on AMD Zen 3 with two
threads (best of repeated runs, SmolLM2's four layer shapes and its lm_head), the native
kernel took 0.80-1.0x oneDNN's time at 16 and 64 rows and 0.66-0.85x at 4096 rows.
This module is the one place that picks: callers keep `F.linear` where neither is
available. `PAGEDLLM_CPU_KERNELS=0` turns both off with the other native kernels.

A third layout serves bf16 products (`prepack_bf16` / `linear_bf16`): on a CPU with AMX,
our tile kernel (csrc/amx.c), else oneDNN's packed bf16 weight, which runs on AVX512-BF16.
Measured on a 2-core Sapphire Rapids (AMX) on SmolLM2's shapes: oneDNN's bf16 ran at
1.4-2.5x the native float32 GEMM at 1 row, 3-4x at 8-32 rows, 5-7x at 64-128 rows; the
AMX kernel took 0.45-0.75x oneDNN's time at 1-64 rows (it streams the weight near memory
speed and skips oneDNN's two conversions) and 0.8-1.5x at 512-1024 rows.
"""

from __future__ import annotations

import functools

import torch

from pagedllm.core import precision
from pagedllm.ops.cpu import features, native

# The batch-size hint oneDNN picks a blocked layout for; any row count works with it.
PACK_HINT_ROWS = 256


@functools.lru_cache(maxsize=1)
def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def available() -> bool:
    """True when float32 CPU weights get packed (see the module doc)."""
    return native.switched_on() and (native.available() or _onednn_available())


def prepack(weight: torch.Tensor) -> native.DenseWeight | torch.Tensor | None:
    """A packed copy of a float32 CPU weight [N, K] (native panels, else oneDNN's
    layout), or None where neither applies."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or not available():
        return None
    if native.available():
        return native.pack_dense(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_HINT_ROWS)


def bf16_available() -> bool:
    """True where bf16 weights can be packed: our kernels (AMX tiles, csrc/amx.c, or
    AVX512-BF16, csrc/bf16dot.c) or oneDNN's layout (oneDNN emulates bf16 on CPUs without
    native support, so callers also check `features.detect().native_bf16`)."""
    return native.switched_on() and (_native_bf16_kernel() is not None or _onednn_available())


def _native_bf16_kernel() -> str | None:
    return native.bf16_tiles_kernel() if native.available() else None


def bf16_kernel() -> str:
    """Which kernel `prepack_bf16` packs for: "amx-bf16" or "avx512-bf16" (ours, where the
    CPU has AMX tiles or AVX512-BF16 dot products), else "onednn-bf16". Crossover cache
    keys name it, so a measurement of one is never read for another."""
    return _native_bf16_kernel() or "onednn-bf16"


def bf16_sums_in_float32() -> bool:
    """Whether `linear_bf16` returns its float32 sums unrounded (our kernels); oneDNN's
    come back rounded to bf16, 8 bits of mantissa, too coarse where bf16 inputs are exact
    (FP8 codes) and only the products were meant to be bf16."""
    return _native_bf16_kernel() is not None


def bf16_products_allowed() -> bool:
    """Whether float32 matmuls may take bf16 inputs now: "medium" float32 matmul precision
    is in force (core/precision.py) and the CPU multiplies bf16 in hardware (AVX512-BF16 or
    AMX; elsewhere bf16 is emulated, slower than float32)."""
    return precision.float32_matmul_precision() == "medium" and features.detect().native_bf16


def prepack_bf16(weight: torch.Tensor) -> native.Bf16Tiles | torch.Tensor:
    """A bf16 copy of a float or bf16 CPU weight [N, K] for `bf16_kernel()`: our tiles, else
    oneDNN's packed layout."""
    if _native_bf16_kernel() is not None:
        return native.pack_bf16_tiles(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16).contiguous(), PACK_HINT_ROWS)


def linear_bf16(x: torch.Tensor, packed: native.Bf16Tiles | torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with bf16 products and float32 sums, for a weight from
    `prepack_bf16`; returns x's dtype. A float32 x is rounded to bf16 going in; our kernels
    return float32 sums as they are, oneDNN's are bf16-rounded on the way out."""
    if isinstance(packed, native.Bf16Tiles):
        return native.bf16_tiles_linear(x, packed, bias)
    if x.dtype == torch.bfloat16:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None if bias is None else bias.to(x.dtype),
                                                  "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "").to(x.dtype)
    if bias is not None:
        out += bias
    return out


def linear_bf16_silu_and_mul(x: torch.Tensor, packed: native.Bf16Tiles | torch.Tensor,
                             bias: torch.Tensor | None) -> torch.Tensor | None:
    """silu(gate) * up of `linear_bf16(x, packed, bias)` ([gate | up]) in one pass, where our
    kernel takes this float32 x (csrc/amx.c's pd_amx_linear_silu, csrc/bf16dot.c's
    pd_bf16dot_linear_silu); None elsewhere (the caller applies the activation to the
    product). On a 2-core Xeon with AMX, SmolLM2's 1,024-row gate/up layer took 1.84 ms fused
    against 2.33 ms for the GEMM and the activation apart, with equal results."""
    if isinstance(packed, native.Bf16Tiles) and native.bf16_tiles_silu_fits(x, packed):
        return native.bf16_tiles_silu_and_mul(x, packed, bias)
    return None


def linear(x: torch.Tensor, packed: native.DenseWeight | torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ W^T (+ bias) with a weight from `prepack`."""
    if isinstance(packed, native.DenseWeight):
        return native.dense_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
