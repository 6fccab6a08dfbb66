"""csrc/blocks.c (the load-time K-quant dequantizer and 32-value rewrites) against the torch
versions in gguf_dequant.py and gguf_blocks32.py, which they replace at load: bitwise equal
on random blocks, every scale bit pattern included. Every test runs on every build (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.cpu import native
from pagedllm.plugins.quant import gguf_blocks32, gguf_dequant
from pagedllm.plugins.quant.gguf_file import Q4_K, Q5_K, Q6_K

from kernel_checks import require_native

require_native()
pytestmark = pytest.mark.usefixtures("build")

K_TYPES = {"Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}


def random_k_blocks(qtype: int, nblocks: int, seed: int) -> torch.Tensor:
    """Random bytes, the f16 fields set to random finite values of every magnitude f16 has
    (subnormals, zero, 65504 included), so each value's rounding is exercised."""
    gen = torch.Generator().manual_seed(seed)
    size = native.K_QUANT_BYTES[qtype]
    raw = torch.randint(0, 256, (nblocks, size), dtype=torch.uint8, generator=gen)
    fields = [208] if qtype == Q6_K else [0, 2]
    for start in fields:
        bits = torch.randint(0, 0x7C00, (nblocks,), dtype=torch.int32, generator=gen)  # finite, positive
        bits |= torch.randint(0, 2, (nblocks,), dtype=torch.int32, generator=gen) << 15  # either sign
        bits[:4] = torch.tensor([0, 0x8000, 0x0001, 0x7BFF])  # 0, -0, smallest subnormal, 65504
        raw[:, start:start + 2] = bits.to(torch.int16).view(torch.uint8).reshape(nblocks, 2)
    return raw


def torch_dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    return gguf_dequant.KERNELS[qtype](raw.reshape(-1, native.K_QUANT_BYTES[qtype])).reshape(-1)


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    same = (got == expected) | (got.isnan() & expected.isnan()) if got.is_floating_point() else got == expected
    if not bool(same.all()):
        i = int((~same).nonzero()[0, 0])
        pytest.fail(f"{what}: first difference at {i}: {got[i].item()!r} against torch's {expected[i].item()!r}")


@pytest.mark.parametrize("name", K_TYPES)
def test_dequantize_k_equals_the_torch_dequantizer(name):
    qtype = K_TYPES[name]
    raw = random_k_blocks(qtype, 257, seed=qtype)
    got = native.dequantize_k(raw, qtype)
    assert_same(got, torch_dequantize(raw, qtype), f"{name} dequantization")
    out = torch.full((257 * 256,), float("nan"))
    assert native.dequantize_k(raw, qtype, out=out) is out and torch.equal(out, got)


def test_q4_k_rewrite_equals_the_torch_rewrite():
    raw = random_k_blocks(Q4_K, 2 * 33, seed=7).reshape(2, -1)  # two rows of 33 super-blocks
    expected = gguf_blocks32.q4_k_as_q4_1_torch(raw, 33 * 256)
    assert_same(native.q4_k_as_q4_1(raw).reshape(-1), expected.reshape(-1), "Q4_K -> Q4_1")


def test_q8_0_rewrite_equals_the_torch_rewrite():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(12, 512, generator=gen) * torch.logspace(-8, 4, 12)[:, None]
    values[0, :32] = 0.0  # an all-zero block: d = 0, codes 0
    values[1, 32:64] = torch.linspace(-1, 1, 32)  # codes at exactly +-127
    values[2, :32] = 65504.0 * 127 / 128  # a scale just inside f16's range
    expected = gguf_blocks32.as_q8_0_torch(values)
    assert_same(native.as_q8_0(values).reshape(-1), expected.reshape(-1), "float32 -> Q8_0")


@pytest.mark.parametrize("bad, message", [(float("nan"), "NaN or infinity"), (float("inf"), "NaN or infinity"),
                                          (1e9, "beyond f16's range")])
def test_q8_0_rewrite_refuses_what_f16_cannot_scale(bad, message):
    values = torch.ones(2, 64)
    values[1, 45] = bad  # not the block's first value: every value is checked
    with pytest.raises(ValueError, match=message):
        native.as_q8_0(values)
    with pytest.raises(ValueError, match=message):
        gguf_blocks32.as_q8_0_torch(values)


def test_wrong_sizes_are_refused():
    with pytest.raises(ValueError, match="not Q4_K, Q5_K or Q6_K"):
        native.dequantize_k(torch.zeros(144, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="whole blocks"):
        native.dequantize_k(torch.zeros(145, dtype=torch.uint8), Q4_K)
    with pytest.raises(ValueError, match="256 contiguous float32"):
        native.dequantize_k(torch.zeros(144, dtype=torch.uint8), Q4_K, out=torch.empty(255))
