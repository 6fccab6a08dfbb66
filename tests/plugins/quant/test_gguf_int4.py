"""Q4_0 / Q4_1 blocks in torch's int4 CPU layout (plugins/quant/gguf_int4.py) against the
dequantized blocks: the same matrix up to bf16's rounding of scales, activations and output."""

from __future__ import annotations

import pytest
import torch

from pagedllm.plugins.quant import gguf_dequant, gguf_int4
from pagedllm.plugins.quant.gguf_file import Q4_0, Q4_1, Q8_0
from tests._ggml_blocks import random_blocks

pytestmark = pytest.mark.skipif(not gguf_int4.available(), reason="torch has no int4 CPU kernel here")


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1], ids=["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_weight_is_the_dequantized_matrix(qtype, rows):
    gen = torch.Generator().manual_seed(qtype * 10 + rows)
    n, k = 48, 128
    raw = random_blocks(qtype, n, k, gen)
    weight = gguf_dequant.dequantize(raw, qtype, (n, k)).double()
    x = torch.randn(rows, k, generator=gen)
    got = gguf_int4.Int4Weight(raw, qtype, k)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    want = x.bfloat16().double() @ weight.t()
    scale = (x.bfloat16().double().abs() @ weight.abs().t()).clamp_min(1e-6)
    worst = ((got.double() - want).abs() / scale).max().item()
    assert worst < 2**-6, f"int4pack differs from the dequantized blocks by {worst:.2e} of the products' size"


def test_other_types_are_refused():
    with pytest.raises(ValueError, match="Q4_0 and Q4_1"):
        gguf_int4.Int4Weight(torch.zeros(4, 34, dtype=torch.uint8), Q8_0, 32)
