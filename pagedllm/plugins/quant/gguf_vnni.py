"""Q4_0 / Q4_1 / Q8_0 (and Q4_K as stored) blocks in csrc/vnni.c's panels, for the few-row
calls of decode and speculative verify steps on CPUs with AVX512-VNNI.

The native float32-exact kernel (quant.c) splits every activation into two int16 terms
and costs nearly as much per extra row as for the first; VNNI's u8 x s8 dot products on
block integers in [-8191, 8191] make one row 3-4x cheaper on a Zen 4 and each more row cheaper
still (SmolLM2's 3072 x 576 Q4_1 layer, 2 threads, weights from memory: ~100 us at 1 row
against ~145, ~190 at 8 rows against ~385). The activations are rounded, so this serves
only where bf16 products are allowed ("medium" float32 matmul precision), and only where
the crossover measured it faster at load, like every other kernel choice.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagedllm.ops.cpu import native


def available() -> bool:
    return native.vnni_available()


class VnniLinear:
    """One layer's block groups (a fused qkv / gate_up may hold several types) in output
    order; called on x [..., K], returns float32 [rows, N]."""

    kind = "vnni"

    def __init__(self, groups: Sequence[tuple[int, torch.Tensor]], k: int) -> None:
        self.k = k
        self.weights: list[tuple[native.VnniWeight, int, int]] = []
        row = 0
        for qtype, raw in groups:
            w = native.pack_vnni(raw, qtype, k)
            self.weights.append((w, row, row + w.n))
            row += w.n
        self.n = row

    def tensors(self) -> list[torch.Tensor]:
        """What it holds, for the layer to register (memory accounting)."""
        return [w.panels for w, _, _ in self.weights]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.k).float().contiguous()
        return native.linear_groups(x2, self.weights, self.n, native.vnni_linear)
