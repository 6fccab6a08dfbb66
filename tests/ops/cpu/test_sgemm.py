"""The dense float32 GEMM (csrc/sgemm.c: pd_sgemm_pack, pd_sgemm) through
native.pack_dense / dense_linear, against float64 matmuls. Every test runs on both
builds (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.cpu import native

from kernel_checks import assert_close_to, require_native

require_native()
pytestmark = pytest.mark.usefixtures("build")


# ------------------------------------------------------------------ dense float32 linear

@pytest.mark.parametrize(("m", "k", "n"), [(1, 8, 16), (5, 33, 17), (6, 288, 32), (13, 289, 50), (100, 700, 3),
                                          (97, 1536, 40)])
def test_dense_linear_matches_float64(m, k, n):
    """Tile edges on every side: rows not a multiple of 6, columns not of 16, K split into
    several blocks (K > 288), one-column outputs."""
    gen = torch.Generator().manual_seed(m * 10000 + k * 10 + n)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = native.pack_dense(w)
    assert packed.panels.shape == ((n + 15) // 16, k, 16) and packed.nbytes == packed.panels.numel() * 4
    expected = x.double() @ w.double().T
    bound = 2e-6 * k * (x.double().abs() @ w.double().abs().T) / k ** 0.5 + 1e-6
    assert_close_to(native.dense_linear(x, packed), expected, bound, f"dense_linear M={m} K={k} N={n}")
    assert_close_to(native.dense_linear(x, packed, bias), expected + bias.double(), bound + bias.abs().double() * 1e-6,
                    f"dense_linear with bias M={m} K={k} N={n}")


def test_dense_linear_reads_strided_rows_and_leading_dims():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(24, 40, generator=gen)
    wide = torch.randn(7, 64, generator=gen)
    x = wide[:, 8:48]  # rows 64 floats apart
    packed = native.pack_dense(w)
    expected = x.double() @ w.double().T
    assert_close_to(native.dense_linear(x, packed), expected, 1e-4, "dense_linear on a column slice of x")
    got = native.dense_linear(x.reshape(1, 7, 40), packed)
    assert got.shape == (1, 7, 24)
    assert_close_to(got[0], expected, 1e-4, "dense_linear with a leading dim")
    assert native.dense_linear(torch.empty(0, 40), packed).shape == (0, 24)


def test_dense_linear_rejects_bad_arguments():
    packed = native.pack_dense(torch.randn(4, 8))
    with pytest.raises(ValueError, match="x"):
        native.dense_linear(torch.randn(2, 9), packed)
    with pytest.raises(ValueError, match="x"):
        native.dense_linear(torch.randn(2, 8, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="bias"):
        native.dense_linear(torch.randn(2, 8), packed, torch.randn(5))
    with pytest.raises(ValueError, match="weight"):
        native.pack_dense(torch.randn(8))
