"""Q4_0 / Q4_1 / Q8_0 blocks dequantized inside the AMX GEMM (csrc/amx.c: pd_amx_qt_pack,
pd_amx_qt_linear) against the bf16 tiles of the same weight's float32 dequantization: every
value equal, since both round the same float32 weights and activations to bf16 and sum the
products alike."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.cpu import native
from pagedllm.plugins.quant.gguf_file import Q4_0, Q4_1, Q5_0, Q8_0

from kernel_checks import require_native
from tests._ggml_blocks import random_blocks

require_native()
pytestmark = pytest.mark.skipif(not native.amx_available(), reason="the quantized tiles kernel runs on AMX tiles only")
QTYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}


@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 32), (5, 48, 64), (16, 960, 576), (17, 32, 96), (31, 80, 64),
                                          (33, 576, 1536), (130, 64, 576)])
def test_quant_tiles_equal_the_bf16_tiles_of_the_dequantized_weight(name, m, n, k):
    """Rows in one or several 32-row blocks and a 16-row tail, an odd number of 16-column
    strips (a lone strip at the end), K over one or many 32-wide blocks."""
    qtype = QTYPES[name]
    gen = torch.Generator().manual_seed(m * 100 + n + k + qtype)
    raw = random_blocks(qtype, n, k, gen)
    packed = native.pack_quant_tiles(raw, qtype, k)
    tile_bytes = 544 if qtype == Q8_0 else 320  # per 16 x 32 values: the codes, d (and Q4_1's m)
    assert packed.nbytes == n // 16 * k // 32 * tile_bytes, f"{name}: tile size"
    x = torch.randn(m, k, generator=gen)
    expected = native.bf16_tiles_linear(x, native.pack_bf16_tiles(native.dequantize(raw, qtype, n, k)))
    got = native.quant_tiles_linear(x, packed)
    assert torch.equal(got, expected), f"{name} M={m} N={n} K={k}: max diff {(got - expected).abs().max()}"
    wide = torch.zeros(m, n + 16)
    native.quant_tiles_linear(x, packed, out=wide[:, 8:8 + n])  # a column slice of a wider output
    assert torch.equal(wide[:, 8:8 + n], expected) and not wide[:, :8].any() and not wide[:, 8 + n:].any()


@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize(("m", "half", "k"), [(1, 16, 64), (5, 48, 64), (17, 64, 96), (32, 1536, 576), (130, 32, 64)])
def test_fused_quant_tiles_equal_the_fused_bf16_tiles(name, m, half, k):
    """The gate/up form pairs gate strip p with up strip p, as the bf16 tiles' fused kernel
    does: silu(gate) * up equal to it, and to the tiles' linear then the activation."""
    qtype = QTYPES[name]
    gen = torch.Generator().manual_seed(m * 10 + half + qtype)
    raw = random_blocks(qtype, 2 * half, k, gen)
    packed, x = native.pack_quant_tiles(raw, qtype, k), torch.randn(m, k, generator=gen)
    got = native.quant_tiles_linear(x, packed, silu_and_mul=True)
    assert got.shape == (m, half)
    assert torch.equal(got, native.silu_mul(native.quant_tiles_linear(x, packed)))
    bf16 = native.pack_bf16_tiles(native.dequantize(raw, qtype, 2 * half, k))
    assert torch.equal(got, native.bf16_tiles_silu_and_mul(x, bf16))


def test_quant_tiles_take_only_what_they_read():
    assert native.quant_tiles_fit(Q4_1, 48, 64) and not native.quant_tiles_fit(Q4_1, 40, 64)
    assert native.quant_tiles_fit(Q4_0, 48, 64) and native.quant_tiles_fit(Q8_0, 48, 64)
    assert not native.quant_tiles_fit(Q5_0, 48, 64), "Q5_0 is read as its Q8_0 rewrite, not as tiles"
    with pytest.raises(ValueError, match="does not fit"):
        native.pack_quant_tiles(random_blocks(Q4_1, 40, 64, torch.Generator().manual_seed(0)), Q4_1, 64)
    packed = native.pack_quant_tiles(random_blocks(Q4_1, 16, 64, torch.Generator().manual_seed(0)), Q4_1, 64)
    with pytest.raises(ValueError, match="x: expected float32"):
        native.quant_tiles_linear(torch.randn(2, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="x: expected float32"):
        native.quant_tiles_linear(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match="whole 16-column strips"):
        native.quant_tiles_linear(torch.randn(2, 64), packed, silu_and_mul=True)  # 16 rows: halves of 8
