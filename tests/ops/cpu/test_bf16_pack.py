"""pd_amx_pack, the bf16 tile layout both bf16 GEMMs read (csrc/amx.c), against the layout
built with torch ops: whole tiles (the AVX-512 path) and edge tiles (the scalar one), bf16
rounding value for value as torch's, NaN, infinities and ties included. Every test runs on
every build (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.cpu import native

from kernel_checks import require_native

require_native()
pytestmark = pytest.mark.usefixtures("build")


def torch_tiles(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> tiles [N/16][K/32] of 16 rows: row r holds (w[n][2r], w[n][2r + 1]) for n = 0..15."""
    n, k = w.shape
    nb, kb = (n + 15) // 16, (k + 31) // 32
    padded = torch.zeros(nb * 16, kb * 32)
    padded[:n, :k] = w
    bits = padded.bfloat16().view(torch.int16).reshape(nb, 16, kb, 16, 2)  # (n block, n, k block, r, e)
    return bits.permute(0, 2, 3, 1, 4).reshape(-1)


@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (17, 33), (5, 20), (64, 576)])
def test_pack_matches_torchs_rounding_and_layout(n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-40, 30, k).clamp(max=1e30)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, -3e-39,
                            1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.4e38])  # ties round to even; the last overflows
    w.view(-1)[: special.numel()] = special
    w.view(-1)[-special.numel():] = special.flip(0)
    got = native.pack_bf16_tiles(w).tiles.view(torch.int16)
    expected = torch_tiles(w)
    nan = expected.view(torch.bfloat16).isnan()
    assert torch.equal(got[~nan], expected[~nan])
    assert bool(got.view(torch.bfloat16)[nan].isnan().all())
