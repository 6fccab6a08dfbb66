"""The layer ops on the native CPU kernels (plugins/cpu_native/ops.py) against each op's
torch reference, including the shapes layers hand them (3-D rows, column slices, a
residual updated in place), and their registration for float32 CPU tensors only."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops
from pagedllm.ops.cpu import features, native
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
    assert {op for op, _ in names} == {"rms_norm", "silu_and_mul", "rotary_qkv", "gather_rows", "argmax_rows",
                                          "pack_linear", "pack_moe"}
    assert ("pack_linear", "cpu_packed_bf16") in names


needs_native_bf16 = pytest.mark.skipif(not features.detect().native_bf16 or not cpu_ops.dense.bf16_available(),
                                       reason="this CPU has no native bf16 (AVX512-BF16/AMX)")


def test_highest_precision_packs_float32_only():
    weight = torch.randn(64, 32)
    packed = cpu_ops.PackedDense(weight)
    assert packed.bf16 is None and packed.kind == "f32"


def test_medium_precision_without_native_bf16_stays_float32(monkeypatch):
    monkeypatch.setattr(features, "detect", lambda: features.CpuFeatures("test CPU", frozenset({"avx2"})))
    with ops.matmul_precision("medium"):
        packed = cpu_ops.PackedDense(torch.randn(64, 32))
    assert packed.bf16 is None, "bf16 products where the CPU emulates bf16"


def _packed_with_crossover(bf16_from: int, gen: torch.Generator, monkeypatch):
    """A random 96 x 64 weight and bias, and the weight packed under "medium" precision as if
    this machine had measured bf16 faster from `bf16_from` rows."""
    monkeypatch.setattr(cpu_ops.crossover, "known", lambda what: None)
    monkeypatch.setattr(cpu_ops.crossover, "rows_from", lambda what, small, large, k: bf16_from)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    with ops.matmul_precision("medium"):
        return weight, bias, cpu_ops.PackedDense(weight)


@needs_native_bf16
@pytest.mark.parametrize("bf16_from", [1, 4, cpu_ops.crossover.NEVER])
def test_medium_precision_follows_the_measured_crossover(bf16_from, monkeypatch):
    """bf16 products from the measured row count (faked here), within bf16's rounding;
    the float32 panels serve fewer rows, and are dropped when bf16 wins from one row."""
    gen = torch.Generator().manual_seed(0)
    weight, bias, packed = _packed_with_crossover(bf16_from, gen, monkeypatch)
    assert (packed.bf16 is None) == (bf16_from == cpu_ops.crossover.NEVER)
    assert (packed.packed is None) == (bf16_from == 1), "float32 panels kept only where they serve"
    for rows in (1, 3, 4, 40):
        x = torch.randn(rows, 64, generator=gen)
        got, exact = packed(x, bias), torch.nn.functional.linear(x, weight, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, 96)
        if rows < bf16_from:
            close(got, exact, f"float32 panels at {rows} rows")
            continue
        want = torch.nn.functional.linear(x.bfloat16().double(), weight.bfloat16().double(), bias.double())
        # bf16 inputs exactly, float32 sums, one bf16 rounding of the product: relative error <= 2^-8
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-2)
        assert not torch.equal(got, exact), f"{rows} rows: medium precision must use bf16 products here"


@needs_native_bf16
@pytest.mark.parametrize("bf16_from", [1, 4, cpu_ops.crossover.NEVER])
def test_a_crossover_measured_before_packs_only_the_layouts_that_serve(bf16_from, monkeypatch):
    """A later start-up on the same machine neither measures again nor packs the loser."""
    def refuse(*_):
        raise AssertionError("packed a layout that never serves, or measured a known crossover")

    monkeypatch.setattr(cpu_ops.crossover, "known", lambda what: bf16_from)
    monkeypatch.setattr(cpu_ops.crossover, "rows_from", refuse)
    if bf16_from == 1:
        monkeypatch.setattr(cpu_ops.dense, "prepack", refuse)
    if bf16_from == cpu_ops.crossover.NEVER:
        monkeypatch.setattr(cpu_ops.dense, "prepack_bf16", refuse)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 64, generator=gen)
    with ops.matmul_precision("medium"):
        packed = cpu_ops.PackedDense(weight)
    assert packed.bf16_from == bf16_from
    assert (packed.packed is None) == (bf16_from == 1)
    assert (packed.bf16 is None) == (bf16_from == cpu_ops.crossover.NEVER)
    x = torch.randn(5, 64, generator=gen)
    if bf16_from <= 5:  # bf16 products: inputs rounded to bf16, float32 sums (see the test above)
        want = torch.nn.functional.linear(x.bfloat16().double(), weight.bfloat16().double())
        torch.testing.assert_close(packed(x, None).double(), want, rtol=2**-8, atol=1e-2)
    else:
        close(packed(x, None), torch.nn.functional.linear(x, weight), "float32 panels")


@pytest.mark.skipif(not cpu_ops.dense.bf16_available(), reason="oneDNN packed linear unavailable")
def test_crossover_is_measured_for_real_layer_shapes(tmp_path, monkeypatch):
    """On a real SmolLM2 shape the measurement runs and gives a candidate row count."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_ops, "bf16_products_pay", lambda: True)
    cpu_ops.crossover.forget()
    with ops.matmul_precision("medium"):
        packed = cpu_ops.PackedDense(torch.randn(960, 576))
    assert packed.bf16_from in (*cpu_ops.crossover.CANDIDATES, cpu_ops.crossover.NEVER)
    assert (tmp_path / "crossovers.json").exists()


@needs_native_bf16
def test_bf16_weights_get_the_packed_bf16_linear():
    weight, x = torch.randn(48, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    packed = cpu_ops.PackedBF16(weight)
    torch.testing.assert_close(packed(x, None).float(), torch.nn.functional.linear(x, weight).float(),
                               rtol=1e-2, atol=1e-2)


def test_bf16_wrappers_match_the_references():
    """The bf16 ops compute in float32 like their references: results equal after the
    final bf16 rounding but for rare one-ulp ties."""
    gen = torch.Generator().manual_seed(3)
    x, res = torch.randn(5, 64, generator=gen).bfloat16(), torch.randn(5, 64, generator=gen).bfloat16()
    weight = torch.rand(64, generator=gen) + 0.5
    bf16 = dict(rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(cpu_ops.rms_norm_bf16(x, weight, 1e-6), ops.rms_norm.reference(x, weight, 1e-6), **bf16)
    got, got_sum = cpu_ops.rms_norm_bf16(x, weight, 1e-6, res.clone())
    want, want_sum = ops.rms_norm.reference(x, weight, 1e-6, res.clone())
    torch.testing.assert_close(got, want, **bf16)
    assert torch.equal(got_sum, want_sum) and got.dtype == torch.bfloat16
    gate_up = torch.randn(3, 80, generator=gen).bfloat16()
    torch.testing.assert_close(cpu_ops.silu_and_mul_bf16(gate_up), ops.silu_and_mul.reference(gate_up), **bf16)
    t, h, kvh, d = 4, 4, 2, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).bfloat16()
    angles = torch.rand(t, d // 2, generator=gen) * 6
    for g, w in zip(cpu_ops.rotary_qkv_bf16(qkv, h, kvh, d, angles.cos(), angles.sin()),
                    ops.rotary_qkv.reference(qkv, h, kvh, d, angles.cos(), angles.sin())):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape
        torch.testing.assert_close(g, w, **bf16)
    assert cpu_ops.bf16_cpu(torch.device("cpu"), torch.bfloat16) == []
    assert cpu_ops.bf16_cpu(torch.device("cpu"), torch.float32)


@pytest.mark.skipif(native.bf16_tiles_kernel() is None, reason="no native bf16 kernel (AMX or AVX512-BF16) here")
@pytest.mark.parametrize("bf16_from", [1, 4])
def test_a_gate_up_weight_fuses_the_activation_where_its_bf16_tiles_serve(bf16_from, monkeypatch):
    """PackedDense.silu_and_mul: None below the bf16 crossover (the float32 panels serve, the
    caller runs the activation), else exactly the native activation of the product."""
    gen = torch.Generator().manual_seed(2)
    _, bias, packed = _packed_with_crossover(bf16_from, gen, monkeypatch)
    for rows in (1, 3, 4, 40):
        x = torch.randn(rows, 64, generator=gen)
        fused = packed.silu_and_mul(x, bias)
        if rows < bf16_from:
            assert fused is None, f"{rows} rows: the float32 panels serve, nothing to fuse"
        else:
            assert torch.equal(fused, cpu_ops.silu_and_mul(packed(x, bias))), f"{rows} rows: fused result differs"
