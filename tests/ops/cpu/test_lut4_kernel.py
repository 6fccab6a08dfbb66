"""pd_linear_lut4 (4-bit codebook weights: bitsandbytes NF4 / FP4) on both builds: against a
float32 GEMM on the dequantized weight, for row counts around its 4-row tiles, block
sizes, column-slice outputs and bad arguments."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.cpu import native

pytestmark = pytest.mark.usefixtures("build")


def weight(n, k, block, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8)
    lut = torch.randn(16, generator=gen)
    absmax = torch.rand(n, k // block, generator=gen) + 0.1
    dense = lut[codes.long()] * absmax.repeat_interleave(block, 1)
    return native.pack_lut4(codes, lut, absmax), dense


@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("block", [16, 64, 128])
def test_matches_the_dequantized_matmul(m, block):
    w, dense = weight(40, 256, block, seed=m + block)
    x = torch.randn(m, 256)
    torch.testing.assert_close(native.lut4_linear(x, w), x @ dense.t(), rtol=1e-5, atol=1e-4)


def test_writes_into_a_column_slice():
    w, dense = weight(24, 128, 64, seed=1)
    x = torch.randn(3, 128)
    out = torch.full((3, 40), 7.0)
    native.lut4_linear(x, w, out[:, 8:32])
    torch.testing.assert_close(out[:, 8:32], x @ dense.t(), rtol=1e-5, atol=1e-4)
    assert bool((out[:, :8] == 7).all() and (out[:, 32:] == 7).all()), "wrote outside its columns"


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block a multiple of 16"):
        native.pack_lut4(torch.zeros(4, 96, dtype=torch.uint8), torch.zeros(16), torch.zeros(4, 4))  # block 24
    w, _ = weight(8, 64, 32, seed=2)
    with pytest.raises(ValueError, match="x has 32 columns"):
        native.lut4_linear(torch.zeros(1, 32), w)
