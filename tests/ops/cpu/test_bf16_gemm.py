"""The native bf16 GEMM (csrc/amx.c's tile layout; AMX tiles or csrc/bf16dot.c's AVX512-BF16
dot products, whichever this CPU has) through native.pack_bf16_tiles / bf16_tiles_linear,
against float64 matmuls on the bf16-rounded inputs: the kernels round x and W to bf16 and
sum in float32, nothing else."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.cpu import dense, native

from kernel_checks import assert_close_to, require_native

require_native()
pytestmark = pytest.mark.skipif(not native.available() or native.bf16_tiles_kernel() is None,
                                reason="this CPU has neither AMX-BF16 nor AVX512-BF16")


_KERNELS = [name for name, here in (("amx-bf16", native.amx_available()), ("avx512-bf16", native.bf16dot_available()))
            if here]


@pytest.fixture(params=_KERNELS or ["none"])
def kernel(request, monkeypatch):
    """Each native bf16 kernel this CPU runs (a CPU with AMX also has AVX512-BF16: its
    bf16dot.c path is tested with AMX switched off)."""
    if request.param == "avx512-bf16":
        monkeypatch.setattr(native, "amx_available", lambda: False)
    assert native.bf16_tiles_kernel() == request.param
    return request.param


def _expected(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    out = xb @ wb.T + (0 if bias is None else bias.double())
    bound = 1e-6 * (xb.abs() @ wb.abs().T) + 1e-6  # float32 sums, in any order
    return out, bound


@pytest.mark.parametrize(("m", "k", "n"), [(1, 32, 16), (3, 33, 17), (8, 64, 48), (9, 100, 50), (13, 576, 960),
                                          (17, 95, 33), (33, 1536, 97), (64, 31, 1), (130, 200, 130),
                                          (300, 64, 96)])
def test_bf16_linear_matches_float64_on_rounded_inputs(m, k, n, kernel):
    """Edges everywhere: rows not a multiple of the 8-row (16 on AMX) block, columns not of a
    strip or a three-strip chunk, K not of a 32-wide tile, one-column outputs, rows over several
    128-row chunks (whole float32 blocks stored straight from the tiles)."""
    gen = torch.Generator().manual_seed(m * 10000 + k * 10 + n)
    w, x, bias = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    packed = native.pack_bf16_tiles(w)
    assert packed.nbytes == (n + 15) // 16 * ((k + 31) // 32) * 512 * 2
    for b in (None, bias):
        expected, bound = _expected(x, w, b)
        assert_close_to(native.bf16_tiles_linear(x, packed, b), expected, bound,
                        f"{native.bf16_tiles_kernel()} M={m} K={k} N={n} bias={b is not None}")


def test_bf16_linear_reads_bf16_rows_strided_rows_and_leading_dims():
    gen = torch.Generator().manual_seed(7)
    w, bias = torch.randn(40, 72, generator=gen), torch.randn(40, generator=gen)
    packed = native.pack_bf16_tiles(w)
    wide = torch.randn(2, 5, 100, generator=gen)
    x = wide[..., 10:82]  # rows of 72 at a stride of 100
    expected, bound = _expected(x.reshape(-1, 72), w, bias)
    got = native.bf16_tiles_linear(x, packed, bias)
    assert got.shape == (2, 5, 40) and got.dtype == torch.float32
    assert_close_to(got.reshape(-1, 40), expected, bound, "strided float32 rows")
    got16 = native.bf16_tiles_linear(x.bfloat16(), packed, bias)  # a bf16 model: one rounding of y, after the bias
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16.reshape(-1, 40), got.reshape(-1, 40).bfloat16()), "bf16 output is not y rounded once"


def test_bf16_linear_keeps_nan_and_zero_rows_apart():
    """A NaN in one row must not reach another (x is rounded and zero-padded row by row)."""
    w = torch.randn(20, 40)
    x = torch.randn(10, 40)
    x[3, 5] = float("nan")
    out = native.bf16_tiles_linear(x, native.pack_bf16_tiles(w))
    assert out[3].isnan().all() and not out[torch.arange(10) != 3].isnan().any()
    assert native.bf16_tiles_linear(torch.empty(0, 40), native.pack_bf16_tiles(w)).shape == (0, 20)


def test_dense_picks_the_native_kernel_and_returns_unrounded_float32_sums():
    assert dense.bf16_kernel() == native.bf16_tiles_kernel() and dense.bf16_sums_in_float32()
    w, x = torch.randn(50, 64), torch.randn(6, 64)
    packed = dense.prepack_bf16(w)
    assert isinstance(packed, native.Bf16Tiles)
    got = dense.linear_bf16(x, packed, None)
    assert not torch.equal(got, got.bfloat16().float()), "outputs came back rounded to bf16"
    expected, bound = _expected(x, w, None)
    assert_close_to(got, expected, bound, "dense.linear_bf16")


def test_rejects_wrong_inputs():
    packed = native.pack_bf16_tiles(torch.randn(8, 16))
    with pytest.raises(ValueError, match="x: expected"):
        native.bf16_tiles_linear(torch.randn(2, 15), packed)
    with pytest.raises(ValueError, match="x: expected"):
        native.bf16_tiles_linear(torch.randn(2, 16, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="bias: expected"):
        native.bf16_tiles_linear(torch.randn(2, 16), packed, torch.randn(7))
    with pytest.raises(ValueError, match=r"weight: expected \[N, K\]"):
        native.pack_bf16_tiles(torch.randn(8))


@pytest.mark.parametrize(("m", "k", "half"), [(1, 64, 16), (5, 33, 32), (16, 576, 48), (17, 100, 16), (32, 40, 64),
                                             (130, 576, 1536 // 8), (300, 64, 96), (7, 64, 80)])
def test_fused_silu_and_mul_equals_the_linear_then_the_activation(m, k, half, kernel):
    """The fused gate/up kernels pair gate strip p with up strip p: the result must be exactly
    silu_mul(bf16_tiles_linear(...)), with and without a bias, for row counts that leave a
    16-row half block (AMX) or a partial 6-row block (AVX512-BF16), rows over several 128-row
    chunks, and an odd number of strips per half (a lone gate/up pair)."""
    gen = torch.Generator().manual_seed(m * 1000 + k + half)
    w, x = torch.randn(2 * half, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(2 * half, generator=gen)
    packed = native.pack_bf16_tiles(w)
    assert native.bf16_tiles_silu_fits(x, packed)
    for b in (None, bias):
        expected = native.silu_mul(native.bf16_tiles_linear(x, packed, b))
        got = native.bf16_tiles_silu_and_mul(x, packed, b)
        assert got.shape == (m, half) and torch.equal(got, expected), \
            f"fused M={m} K={k} N/2={half} bias={b is not None}: max diff {(got - expected).abs().max()}"
    assert dense.linear_bf16_silu_and_mul(x.view(1, m, k), packed, None).shape == (1, m, half)


def test_fused_silu_and_mul_is_declined_where_it_does_not_apply(kernel):
    """dense.linear_bf16_silu_and_mul says None (the caller runs the two ops) for bf16 activations
    (the unfused product is rounded before the activation) and for halves that split a strip."""
    x = torch.randn(4, 64)
    assert dense.linear_bf16_silu_and_mul(x.bfloat16(), native.pack_bf16_tiles(torch.randn(64, 64)), None) is None
    assert dense.linear_bf16_silu_and_mul(x, native.pack_bf16_tiles(torch.randn(48, 64)), None) is None
    with pytest.raises(ValueError, match="bf16_tiles_silu_fits"):
        native.bf16_tiles_silu_and_mul(x, native.pack_bf16_tiles(torch.randn(48, 64)))
