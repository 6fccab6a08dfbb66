"""The Triton block-FP8 GEMM (plugins/quant/triton_fp8.py), interpreted on the CPU
(compiled on a GPU): against the dequantized weights, including subnormal, negative and
largest codes, partial blocks and tiles; and inside Fp8LinearMethod as CUDA runs it."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagedllm.plugins.quant import triton_fp8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dequantize(codes, scales, block):
    bn, bk = block
    n, k = codes.shape
    return codes.float() * scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


@pytest.mark.parametrize("n,k,block,m", [(64, 128, (32, 64), 3), (40, 96, (16, 32), 17), (130, 256, (128, 128), 1)])
def test_kernel_matches_the_dequantized_weights(n, k, block, m):
    gen = torch.Generator().manual_seed(n + k + m)
    codes = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes.view(torch.uint8)[0, :4] = torch.tensor([0x01, 0x81, 0x7E, 0x00], dtype=torch.uint8)  # subnormals, 448, 0
    scales = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=gen)
    y = triton_fp8.linear(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), block)
    torch.testing.assert_close(y.cpu(), x @ dequantize(codes, scales, block).t(), rtol=1e-4, atol=1e-4)


def test_block_fp8_layer_keeps_its_codes_on_the_triton_path(monkeypatch):
    """Fp8LinearMethod on a block-scaled checkpoint, with the kernel CUDA picks: no dense
    copy, the same product as the dequantized weights (weight-only activations)."""
    from torch import nn

    from pagedllm.plugins.quant import fp8

    monkeypatch.setattr(fp8, "block_kernel", lambda device, block, k: "triton")
    monkeypatch.setattr(fp8, "quantizes_activations", lambda device: False)
    gen = torch.Generator().manual_seed(5)
    block, sizes, k = (16, 32), [32, 16], 64
    cfg = fp8.Fp8Config(serialized=True, static=False, block=block, skip=[])
    method = fp8.Fp8LinearMethod(cfg)
    layer = nn.Module()
    layer.prefix = "test.qkv_proj"
    with torch.device(DEVICE):  # as the engine builds its layers
        method.create_weights(layer, k, sizes, torch.float32)
    codes = (torch.randn(sum(sizes), k, generator=gen) * 30).to(torch.float8_e4m3fn)
    scales = torch.rand(sum(sizes) // block[0], k // block[1], generator=gen) * 0.01 + 1e-3
    layer.weight.data.copy_(codes)
    layer.weight_scale_inv.data.copy_(scales)
    method.process_after_loading(layer)
    assert layer.fp8_triton is not None and "triton" in layer.fp8_kind.lower()
    x = torch.randn(5, k, generator=gen)
    want = x @ dequantize(codes, scales, block).t()
    torch.testing.assert_close(method.apply(layer, x.to(DEVICE), None).cpu(), want, rtol=1e-4, atol=1e-4)
