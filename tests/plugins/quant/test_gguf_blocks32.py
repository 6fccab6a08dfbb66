"""K-quant and Q5 blocks rewritten as the 32-value blocks the native CPU kernels read
(gguf_blocks32.py): each rewrite stays within the rounding its docstring promises of the
file's exact values, and refuses what it cannot represent."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.plugins.quant import gguf_blocks32  # noqa: E402
from pagedllm.plugins.quant.gguf_dequant import dequantize  # noqa: E402
from pagedllm.plugins.quant.gguf_file import (  # noqa: E402
    BLOCK_LAYOUTS, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
)
from tests._ggml_blocks import quantize_q4_k, quantize_q6_k  # noqa: E402

T = gguf.GGMLQuantizationType
N, K = 6, 512


def _weights(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.05
    w[0, :256] *= 1e-3  # a super-block of tiny weights: scales below f16's normal range
    w[1, 5] = 0.9  # an outlier that sets its block's scale
    return w


def test_test_encoders_agree_with_ggufs_own_dequantizer() -> None:
    """The test's Q4_K / Q6_K writers produce valid blocks (read back by gguf-py, an
    implementation independent of ours) close to the weights they encode."""
    w = _weights()
    for encode, qtype, rel in ((quantize_q4_k, T.Q4_K, 0.12), (quantize_q6_k, T.Q6_K, 0.03)):
        raw = encode(w)
        ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).reshape(N, K)
        assert torch.equal(ref, dequantize(raw, int(qtype), (N, K))), f"{qtype.name}: our dequantizer differs"
        assert (ref - w).norm() / w.norm() < rel, f"{qtype.name}: the test encoder is too coarse"


def test_target_types() -> None:
    assert [gguf_blocks32.target_type(q) for q in (Q4_0, Q4_1, Q8_0)] == [Q4_0, Q4_1, Q8_0]
    assert gguf_blocks32.target_type(Q4_K) == Q4_1
    assert all(gguf_blocks32.target_type(q) == Q8_0 for q in (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K))
    assert gguf_blocks32.target_type(F32) is None and gguf_blocks32.target_type(F16) is None
    with pytest.raises(ValueError, match="no 32-value block form"):
        gguf_blocks32.as_native_blocks(torch.zeros(1, 4, dtype=torch.uint8), F32, 1)


def test_q4_k_keeps_its_codes_and_rounds_only_the_scales_to_f16() -> None:
    raw = quantize_q4_k(_weights())
    qtype, blocks = gguf_blocks32.as_native_blocks(raw, Q4_K, K)
    assert qtype == Q4_1 and blocks.shape == (N, K // 32 * 20)
    exact, got = dequantize(raw, Q4_K, (N, K)), dequantize(blocks, Q4_1, (N, K))
    # per block: codes q in 0..15 unchanged, d and m each off by at most half an f16 ulp
    exact_b, got_b = exact.reshape(-1, 32), got.reshape(-1, 32)
    fields = blocks.reshape(-1, 20)[:, :4].contiguous().view(torch.float16).float().abs()  # d, m
    half_ulp = fields * 2.0 ** -11 + 2.0 ** -25
    bound = 15 * half_ulp[:, :1] + half_ulp[:, 1:]
    assert ((got_b - exact_b).abs() <= bound).all(), "Q4_K -> Q4_1 moved a weight by more than f16 scale rounding"
    assert (got - exact).abs().max() > 0, "expected some f16 rounding (else the test checks nothing)"


@pytest.mark.parametrize("qtype", [Q6_K, Q5_K, Q5_0, Q5_1, Q3_K, Q2_K])
def test_requantized_to_q8_0_within_half_a_step(qtype) -> None:
    w = _weights(1)
    raw = quantize_q6_k(w) if qtype == Q6_K else torch.from_numpy(_gguf_quantize(w, qtype))
    exact = dequantize(raw, qtype, (N, K))
    target, blocks = gguf_blocks32.as_native_blocks(raw, qtype, K)
    assert target == Q8_0 and blocks.shape == (N, K // 32 * 34)
    got = dequantize(blocks, Q8_0, (N, K))
    amax = exact.reshape(-1, 32).abs().amax(1, keepdim=True)
    d = blocks.reshape(-1, 34)[:, :2].contiguous().view(torch.float16).float()
    assert (d * 127 >= amax).all(), "a Q8_0 scale was rounded down (codes would clip)"
    assert (d <= amax / 127 * (1 + 2.0 ** -10) + 2.0 ** -24).all()
    assert ((got - exact).reshape(-1, 32).abs() <= d / 2 + 1e-12).all(), "a value moved by more than half a step"


def _gguf_quantize(w: torch.Tensor, qtype: int):
    """Q5 types through gguf-py's own quantizer; the K types it cannot write (NotImplemented)
    come from random blocks with small finite scales instead."""
    try:
        return gguf.quants.quantize(w.numpy(), T(qtype))
    except NotImplementedError:
        block, size = BLOCK_LAYOUTS[qtype]
        gen = torch.Generator().manual_seed(qtype)
        raw = torch.randint(0, 256, (N * K // block, size), dtype=torch.uint8, generator=gen)
        f16_at = {Q2_K: (80, 82), Q3_K: (108,), Q5_K: (0, 2)}[qtype]
        for at in f16_at:
            raw[:, at:at + 2] = (torch.rand(raw.shape[0], 1, generator=gen) * 1e-3).half().view(torch.uint8)
        return raw.reshape(N, -1).numpy()


def test_non_finite_weights_are_refused() -> None:
    values = torch.zeros(2, 64)
    values[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinity"):
        gguf_blocks32.as_q8_0(values)
    values[1, 3] = 1e7  # beyond what an f16 scale can carry (1e7 / 127 > 65504)
    with pytest.raises(ValueError, match="beyond f16's range"):
        gguf_blocks32.as_q8_0(values)
