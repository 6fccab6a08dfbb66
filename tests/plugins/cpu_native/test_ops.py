"""The layer ops on the native CPU kernels (plugins/cpu_native/ops.py) against each op's
torch reference, including the shapes layers hand them (3-D rows, column slices, a
residual updated in place), and their registration for float32 CPU tensors only."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops
from pagedllm.ops.cpu import native
from pagedllm.plugins.cpu_native import ops as cpu_ops

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")


def close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 16)])
def test_rms_norm_with_and_without_residual(shape):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen)
    weight = torch.rand(shape[-1], generator=gen) + 0.5
    residual = torch.randn(*shape, generator=gen)
    close(cpu_ops.rms_norm(x, weight, 1e-6), ops.rms_norm.reference(x, weight, 1e-6), f"rms_norm {shape}")
    want_out, want_sum = ops.rms_norm.reference(x, weight, 1e-6, residual.clone())
    got_out, got_sum = cpu_ops.rms_norm(x, weight, 1e-6, residual.clone())
    close(got_out, want_out, f"rms_norm with residual {shape}")
    close(got_sum, want_sum, f"the returned residual sum {shape}")
    assert got_sum.shape == residual.shape


def test_silu_and_mul_on_rows_and_3d():
    x = torch.randn(2, 3, 40)
    close(cpu_ops.silu_and_mul(x), ops.silu_and_mul.reference(x), "silu_and_mul 3-D")
    close(cpu_ops.silu_and_mul(x[0]), ops.silu_and_mul.reference(x[0]), "silu_and_mul rows")


@pytest.mark.parametrize("contiguous", [True, False])
def test_rotary_qkv_matches_reference(contiguous):
    t, h, kvh, d = 6, 4, 2, 32
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(t, (h + 2 * kvh) * d + (0 if contiguous else 8), generator=gen)
    qkv = wide if contiguous else wide[:, 8:]
    angles = torch.rand(t, d // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    want = ops.rotary_qkv.reference(qkv.clone(), h, kvh, d, cos, sin)
    got = cpu_ops.rotary_qkv(qkv.clone(), h, kvh, d, cos, sin)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        close(g, w, f"rotary_qkv {name} (contiguous={contiguous})")


def test_gather_rows_and_packed_linear():
    table, ids = torch.randn(30, 8), torch.tensor([4, 0, 29, 4])
    assert torch.equal(cpu_ops.gather_rows(table, ids), table[ids])
    weight, x, bias = torch.randn(48, 32), torch.randn(5, 32), torch.randn(48)
    packed = cpu_ops.PackedDense(weight)
    assert packed.owns_copy
    close(packed(x, bias), ops.pack_linear.reference(weight)(x, bias), "packed linear")


def test_offered_for_float32_cpu_only():
    assert cpu_ops.float32_cpu(torch.device("cpu"), torch.float32) == []
    assert cpu_ops.float32_cpu(torch.device("cpu"), torch.bfloat16), "bfloat16 must be refused"
    assert cpu_ops.float32_cpu(torch.device("cuda"), torch.float32), "CUDA tensors must be refused"
    names = {(impl.op, impl.name) for impl in cpu_ops.OP_IMPLS}
    assert {op for op, _ in names} == {"rms_norm", "silu_and_mul", "rotary_qkv", "gather_rows", "pack_linear"}
