"""Dense float32 linears on the CPU through oneDNN, with weights packed once at load.

`F.linear` hands MKL the plain [N, K] weight on every call, which repacks it into its
blocked layout each time: at decode batch sizes (8-64 rows) that costs as much as the
multiply (measured on SmolLM2's shapes, AVX2, 2 threads: 1.3-2.4x faster packed at
9-64 rows, the 49152-row lm_head 1.9x at 64 rows; equal at 4096 rows). torch ships
oneDNN's packed-weight linear (the kernels its inductor uses); this module is the one
place that calls it, so callers fall back to `F.linear` where it is missing.
`PAGEDLLM_CPU_KERNELS=0` turns it off with the native kernels.
"""

from __future__ import annotations

import functools

import torch

from pagedllm.plugins.cpu import native

# The batch-size hint oneDNN picks a blocked layout for; any row count works with it.
PACK_HINT_ROWS = 256


@functools.lru_cache(maxsize=1)
def available() -> bool:
    if not native.switched_on():
        return False
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a float32 CPU weight [N, K], or None where it does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or not available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_HINT_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ W^T (+ bias) with a weight from `prepack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
