"""The Triton dequant-GEMM for grouped integer weights, interpreted on the CPU (compiled on
a GPU): against the dequantized formula, for 4 and 8 bits, zeros, act-order permutations and
fused parts, and inside IntLinear as the CUDA path runs it."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagedllm.plugins.quant import triton_int  # noqa: E402
from pagedllm.plugins.quant.int_weights import IntGroups, IntLinear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_groups(n, k, group, bits, seed, perm=False):
    gen = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (n, k), generator=gen).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, top + 1, (n, k // group), generator=gen).float()
    order = torch.randperm(k, generator=gen) if perm else None
    return IntGroups(codes, scales, zeros, group, bits, order)


@pytest.mark.parametrize("bits,group,m", [(4, 32, 3), (4, 64, 17), (8, 32, 5), (4, 16, 1), (4, 128, 40)])
def test_kernel_matches_the_dequantized_formula(bits, group, m):
    g = random_groups(48, 128, group, bits, seed=bits + group)
    x = torch.randn(m, 128)
    words = triton_int.pack(g.codes, bits).to(DEVICE)
    y = triton_int.linear(x.to(DEVICE), words, g.scales.t().contiguous().to(DEVICE),
                          g.zeros.t().contiguous().to(DEVICE), group, bits)
    torch.testing.assert_close(y.cpu(), x @ g.dequantize().t(), rtol=1e-4, atol=1e-4)


def test_int_linear_on_the_triton_path_with_act_order_and_fused_parts():
    parts = [random_groups(32, 64, 32, 4, seed=1, perm=True), random_groups(16, 64, 32, 4, seed=2)]
    layer = IntLinear(parts, torch.float32, DEVICE, "test", kernel="triton")
    assert layer.kind == "triton-int4+int4"
    x = torch.randn(4, 64)
    want = x @ torch.cat([p.dequantize() for p in parts]).t()
    torch.testing.assert_close(layer(x.to(DEVICE), None).cpu(), want, rtol=1e-4, atol=1e-4)
