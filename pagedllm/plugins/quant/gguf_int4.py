"""Q4_0 / Q4_1 blocks as torch's packed int4 CPU weight, for single-row decode.

torch ships an int4 x bf16 matrix-vector kernel for the CPU (`_weight_int4pack_mm_for_cpu`,
weights in groups with a bf16 scale and zero each: value = (q - 8) * scale + zero). ggml's
4-bit blocks map onto it exactly but for the bf16 rounding of the scales: Q4_1's
d * q + m is (q - 8) * d + (m + 8 d), Q4_0's d * (q - 8) has zero 0. The activations go in
as bf16, so this serves only under "medium" float32 matmul precision. Measured on a
2-core Sapphire Rapids: 3072 x 576 at one row in 83 us against the native Q4_1 kernel's
146 us; at 8+ rows it loses to oneDNN's bf16 GEMM. Whether it is used is measured per
layer shape at load (crossover.py), like every other kernel choice.
"""

from __future__ import annotations

import torch

from pagedllm.plugins.quant.gguf_dequant import _f16, _nibbles
from pagedllm.plugins.quant.gguf_file import Q4_0, Q4_1, check_supported

GROUP = 32  # one ggml block per group
QTYPES = (Q4_0, Q4_1)


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


class Int4Weight:
    """A [N, K] Q4_0/Q4_1 matrix in torch's int4 CPU layout; called on float32 x [M, K]."""

    kind = "int4pack"

    def __init__(self, raw: torch.Tensor, qtype: int, k: int) -> None:
        if qtype not in QTYPES:
            raise ValueError(f"int4pack takes Q4_0 and Q4_1 blocks, not ggml type {qtype}")
        _, type_size = check_supported(qtype, "tensor")
        n, groups = raw.shape[0], k // GROUP
        blocks = raw.reshape(-1, type_size)
        d = _f16(blocks, 0)
        if qtype == Q4_1:
            zero, codes = _f16(blocks, 2) + 8 * d, blocks[:, 4:20]
        else:
            zero, codes = torch.zeros_like(d), blocks[:, 2:18]
        q = _nibbles(codes).reshape(n, k).to(torch.int32)
        self.n, self.k = n, k
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        self.scales_zeros = torch.stack((d.view(n, groups).t(), zero.view(n, groups).t()), dim=-1) \
            .to(torch.bfloat16).contiguous()  # [K / GROUP, N, 2]

    def tensors(self) -> list[torch.Tensor]:
        """What it holds, for the layer to register (memory accounting)."""
        return [self.packed, self.scales_zeros]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self.k).to(torch.bfloat16), self.packed, GROUP,
                                                 self.scales_zeros)
        return out.to(x.dtype)
