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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton interpreter multiplies bf16 tiles as integers")
def test_16_bit_activations_multiply_in_their_dtype():
    """A bf16 model's activations stay bf16 (tensor-core products on a GPU): the tile is
    rounded to bf16, the sums stay float32."""
    g = random_groups(48, 128, 32, 4, seed=9)
    x = torch.randn(5, 128).to(torch.bfloat16)
    words = triton_int.pack(g.codes, 4).to(DEVICE)
    y = triton_int.linear(triton_int.operand(x.to(DEVICE)), words, g.scales.t().contiguous().to(DEVICE),
                          g.zeros.t().contiguous().to(DEVICE), 32, 4)
    assert y.dtype == torch.float32
    want = x.float() @ g.dequantize().to(torch.bfloat16).float().t()
    torch.testing.assert_close(y.cpu(), want, rtol=1e-4, atol=1e-3)


def test_int_linear_on_the_triton_path_with_act_order_and_fused_parts():
    parts = [random_groups(32, 64, 32, 4, seed=1, perm=True), random_groups(16, 64, 32, 4, seed=2)]
    layer = IntLinear(parts, torch.float32, DEVICE, "test", kernel="triton")
    assert layer.kind == "triton-int4+int4"
    x = torch.randn(4, 64)
    want = x @ torch.cat([p.dequantize() for p in parts]).t()
    torch.testing.assert_close(layer(x.to(DEVICE), None).cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block,m", [(64, 3), (16, 17), (128, 1)])
def test_codebook_mode_matches_the_dequantized_formula(block, m):
    """bitsandbytes NF4: w = quant_map[code] * absmax[block], from the same kernel."""
    from pagedllm.plugins.quant.bitsandbytes import NF4

    gen = torch.Generator().manual_seed(block + m)
    codes = torch.randint(0, 16, (40, 128), generator=gen).to(torch.uint8)
    absmax = torch.rand(40, 128 // block, generator=gen) + 0.05
    lut = torch.tensor(NF4)
    x = torch.randn(m, 128, generator=gen)
    y = triton_int.linear(x.to(DEVICE), triton_int.pack(codes, 4).to(DEVICE), absmax.t().contiguous().to(DEVICE),
                          lut.to(DEVICE), block, 4, codebook=True)
    dense = lut[codes.long()] * absmax.repeat_interleave(block, dim=1)
    torch.testing.assert_close(y.cpu(), x @ dense.t(), rtol=1e-4, atol=1e-4)


def test_bitsandbytes_4bit_layer_on_the_triton_path(monkeypatch):
    """BnB4bitMethod keeps the codes 4-bit on the Triton kernel (what CUDA picks): fused
    shards in-flight quantized to NF4 give the dequantized weights' product."""
    from torch import nn

    from pagedllm.plugins.quant import bitsandbytes as bnb

    monkeypatch.setattr(bnb, "codebook_kernel", lambda device, block, k: "triton")
    gen = torch.Generator().manual_seed(3)
    sizes = [32, 16]
    weights = [torch.randn(n, 128, generator=gen) for n in sizes]
    layer, method = nn.Module(), bnb.BnB4bitMethod()
    layer.prefix = "test.qkv_proj"
    method.create_weights(layer, 128, sizes, torch.float32)
    for shard, w in enumerate(weights):
        layer.weight.weight_loader(layer.weight, w.to(DEVICE), shard)
    expected = torch.cat([torch.tensor(bnb.NF4)[c.long()] * a.repeat_interleave(64, dim=1)
                          for c, a in (bnb.quantize_nf4(w) for w in weights)])
    method.process_after_loading(layer)
    assert layer.bnb_triton and not layer.bnb_kernels and layer.bnb_dense is None
    x = torch.randn(5, 128, generator=gen)
    torch.testing.assert_close(method.apply(layer, x.to(DEVICE), None).cpu(), x @ expected.t(), rtol=1e-4, atol=1e-4)
