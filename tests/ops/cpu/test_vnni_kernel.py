"""The VNNI kernel for ggml weights (csrc/vnni.c) through native.pack_vnni / vnni_linear, in
both its forms (AVX512-VNNI, and AVX2 for CPUs without VNNI), against float64 matmuls on
the dequantized weights, within the error its numerics allow: each 32-value block of an
activation row is rounded to integers of 1/8191 of its largest value (at most half a step,
1/16382 of the maximum, per value), or of 1/127 in the int8 form (1/254), the rest is exact
integer arithmetic and float32 sums."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.cpu import native
from pagedllm.plugins.quant import gguf_dequant
from pagedllm.plugins.quant.gguf_file import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0

from kernel_checks import assert_close_to, require_native
from tests._ggml_blocks import BLOCK_BYTES, random_blocks

require_native()
needs_vnni = pytest.mark.skipif(not native.vnni_available(), reason="this build has no form of the VNNI kernel")
# every test below that multiplies runs in each form a build here has: this machine's own, the
# AVX2-only build and, where the CPU has AVX-VNNI, the AVX2 + AVX-VNNI build
FORMS = pytest.mark.parametrize("form", ["avx512", "avx2", "avx-vnni"])
FORM_BUILDS = {"avx2": "avx2_build", "avx-vnni": "avx_vnni_build"}


@pytest.fixture
def use_form(request):
    """use_form(form): route `native` through a build with that form of the kernel, or skip."""
    def use(form: str) -> None:
        if native.vnni_form() == form:
            return
        if form in FORM_BUILDS:
            request.getfixturevalue(FORM_BUILDS[form])
            if native.vnni_form() == form:
                return
        pytest.skip(f"no build here has the {form} form of the VNNI kernel")
    return use

QTYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
K_QUANTS = {"Q4_K": Q4_K}  # rows of whole 256-value super-blocks
ALL_QTYPES = {**QTYPES, **K_QUANTS}
# a panel column's bytes per super-block: Q4_K's d, dmin, codes and 8 sc and m bytes (the
# file packs them in 6 bits: 144)
K_QUANT_COLUMN_BYTES = {Q4_K: 148}


def _expected(x: torch.Tensor, raw: torch.Tensor, qtype: int, int8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ W^T in float64, and the bound: the activation rounding (1/16382 of each block's
    largest |x|, 1/254 with int8, times that block's sum of |w|), plus float32 summation."""
    n, k = raw.shape[0], x.shape[1]
    w = gguf_dequant.dequantize(raw, qtype, (n, k)).double()
    xd = x.double()
    block_max = xd.abs().view(-1, k // 32, 32).amax(-1)  # [M, K/32]
    w_block = w.abs().view(n, k // 32, 32).sum(-1)  # [N, K/32]
    bound = 1.001 * (block_max / (254 if int8 else 16382)) @ w_block.T + 2e-6 * (xd.abs() @ w.abs().T) + 1e-30
    return xd @ w.T, bound


@needs_vnni
@pytest.mark.parametrize("int8", [False, True], ids=["14bit", "int8"])
@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 32), (3, 40, 64), (8, 33, 96), (9, 576, 576), (17, 100, 96),
                                          (2, 1, 32), (64, 48, 160), (31, 24, 64)])
@FORMS
def test_vnni_linear_matches_float64_within_its_rounding(name, m, n, k, int8, form, use_form):
    """Edges: columns not a multiple of the 16-column panel, row counts that split into every
    register block size (12 or 8, then 8, 4, 2, 1: 31 = 12 + 12 + 4 + 2 + 1 and 24 + 4 + 2 + 1),
    one-column and one-block weights."""
    use_form(form)
    qtype = QTYPES[name]
    gen = torch.Generator().manual_seed(qtype * 1000 + m * 100 + n + k)
    raw = random_blocks(qtype, n, k, gen)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, k // 32, 1, generator=gen).expand(m, k // 32, 32).reshape(m, k)
    w = native.pack_vnni(raw, qtype, k)
    assert w.nbytes == (n + 15) // 16 * 16 * k // 32 * BLOCK_BYTES[qtype], "the panels are not the file's bytes"
    got = native.vnni_linear(x, w, int8=int8)
    assert got.shape == (m, n) and got.dtype == torch.float32
    expected, bound = _expected(x, raw, qtype, int8)
    assert_close_to(got, expected, bound, f"{name} M={m} N={n} K={k} int8={int8}")


@needs_vnni
@pytest.mark.parametrize("int8", [False, True], ids=["14bit", "int8"])
@pytest.mark.parametrize("name", K_QUANTS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 256), (3, 40, 512), (8, 33, 256), (9, 100, 768), (17, 24, 256),
                                          (2, 1, 256)])
@FORMS
def test_vnni_linear_reads_k_quants_as_stored(name, m, n, k, int8, form, use_form):
    """Q4_K's codes and sub-block scales as the file holds them (4.625 bits per weight, against
    5 for its Q4_1 rewrite): the same error bound as the 32-value types, the weights
    themselves exact; edges of panels, row blocks and one column."""
    use_form(form)
    qtype = K_QUANTS[name]
    gen = torch.Generator().manual_seed(qtype * 1000 + m * 100 + n + k)
    raw = random_blocks(qtype, n, k, gen)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, k // 32, 1, generator=gen).expand(m, k // 32, 32).reshape(m, k)
    w = native.pack_vnni(raw, qtype, k)
    assert w.nbytes == (n + 15) // 16 * 16 * k // 256 * K_QUANT_COLUMN_BYTES[qtype], f"{name}: panel size"
    expected, bound = _expected(x, raw, qtype, int8)
    assert_close_to(native.vnni_linear(x, w, int8=int8), expected, bound,
                    f"{name} M={m} N={n} K={k} int8={int8} {form}")


@needs_vnni
@pytest.mark.parametrize("name", ALL_QTYPES)
@FORMS
def test_vnni_linear_is_much_closer_than_bf16_activations(name, form, use_form):
    """The point of 13-bit block integers: on smooth activations the error is well below what
    rounding x to bf16 alone gives."""
    use_form(form)
    qtype = ALL_QTYPES[name]
    gen = torch.Generator().manual_seed(5)
    raw = random_blocks(qtype, 64, 256, gen)
    x = torch.randn(4, 256, generator=gen)
    expected, _ = _expected(x, raw, qtype)
    vnni_err = (native.vnni_linear(x, native.pack_vnni(raw, qtype, 256)).double() - expected).abs().mean()
    bf16_err = (_expected(x.bfloat16().float(), raw, qtype)[0] - expected).abs().mean()
    assert vnni_err < 0.25 * bf16_err, f"{name}: mean error {vnni_err:.3g} vs bf16 activations' {bf16_err:.3g}"


@needs_vnni
@FORMS
def test_vnni_linear_writes_a_column_slice_and_nothing_else(form, use_form):
    use_form(form)
    gen = torch.Generator().manual_seed(3)
    raw = random_blocks(Q4_1, 24, 64, gen)
    x = torch.randn(5, 64, generator=gen)
    out = torch.full((5, 40), 7.0)
    w = native.pack_vnni(raw, Q4_1, 64)
    native.vnni_linear(x, w, out[:, 10:34])
    assert torch.equal(out[:, 10:34], native.vnni_linear(x, w)), \
        "a column slice got other values than a whole output"
    assert (out[:, :10] == 7).all() and (out[:, 34:] == 7).all(), "columns outside the slice were written"


def _offsets(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """float64 [N, k]: the part of each weight the kernels multiply by the block's float sum
    of x (Q4_1's m, Q4_K's -dmin * m: the value of code 0); zero where the offset is taken off
    in integers (Q4_0's -8d, Q8_0)."""
    n = raw.shape[0]
    if qtype not in (Q4_1, Q4_K):
        return torch.zeros(n, k, dtype=torch.float64)
    block, codes_from = (20, 4) if qtype == Q4_1 else (144, 16)
    zeroed = raw.clone()
    zeroed.view(n, -1, block)[:, :, codes_from:] = 0
    return gguf_dequant.dequantize(zeroed, qtype, (n, k)).double()


@needs_vnni
@pytest.mark.parametrize("name", ALL_QTYPES)
@FORMS
def test_vnni_linear_int8_rounds_like_llama_cpp(name, form, use_form):
    """The int8 form is not the 14-bit one with a looser bound: its error is that of rounding
    each block of x to 1/127 of its maximum (llama.cpp's Q8 activations) in the products with
    the codes and nothing more (Q4_1's and Q4_K's offsets multiply the block's exact sum)."""
    use_form(form)
    qtype = ALL_QTYPES[name]
    gen = torch.Generator().manual_seed(7)
    raw = random_blocks(qtype, 48, 256, gen)
    x = torch.randn(13, 256, generator=gen)
    blocks = x.view(13, 8, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(blocks / step) * step).view(13, 256)
    scaled, bound = _expected(rounded, raw, qtype)  # the rounded x, with the 14-bit bound
    expected = scaled + (x.double() - rounded.double()) @ _offsets(raw, qtype, 256).T
    w = native.pack_vnni(raw, qtype, 256)
    assert_close_to(native.vnni_linear(x, w, int8=True), expected, bound, f"{name}: int8 rounding")
    exact, _ = _expected(x, raw, qtype)
    int8_err = (native.vnni_linear(x, w, int8=True).double() - exact).abs().mean()
    fine_err = (native.vnni_linear(x, w).double() - exact).abs().mean()
    assert int8_err > 4 * fine_err, f"{name}: the int8 form is as close as the 14-bit one: did it round at all?"


@needs_vnni
@pytest.mark.parametrize("int8", [False, True], ids=["14bit", "int8"])
@pytest.mark.parametrize("name", ALL_QTYPES)
@FORMS
def test_vnni_linear_keeps_nan_inf_and_zero_rows_apart(name, int8, form, use_form):
    """A NaN or infinity in one row's block makes that row NaN and leaves the others as they
    were; an all-zero row gives zeros (its block scales are 0, not 0/0)."""
    use_form(form)
    qtype = ALL_QTYPES[name]
    k = 256 if qtype in K_QUANTS.values() else 96
    gen = torch.Generator().manual_seed(11)
    raw = random_blocks(qtype, 20, k, gen)
    w = native.pack_vnni(raw, qtype, k)
    x = torch.randn(6, k, generator=gen)
    clean = native.vnni_linear(x, w, int8=int8)
    x[1, 40], x[3, k - 1] = float("nan"), float("inf")
    x[4] = 0
    got = native.vnni_linear(x, w, int8=int8)
    assert got[[1, 3]].isnan().all(), f"{name}: a non-finite activation did not poison its row"
    assert torch.equal(got[[0, 2, 5]], clean[[0, 2, 5]]), f"{name}: a non-finite row changed other rows"
    assert torch.equal(got[4], torch.zeros(20)), f"{name}: an all-zero row is not zero"


@needs_vnni
def test_vnni_linear_refuses_bad_operands():
    raw = random_blocks(Q8_0, 16, 64, torch.Generator().manual_seed(0))
    w = native.pack_vnni(raw, Q8_0, 64)
    with pytest.raises(ValueError, match="columns"):
        native.vnni_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="contiguous"):
        native.vnni_linear(torch.randn(64, 2).T, w)
    with pytest.raises(ValueError, match="float32"):
        native.vnni_linear(torch.randn(2, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match=r"float32 \[2, 16\]"):
        native.vnni_linear(torch.randn(2, 64), w, torch.empty(2, 15))


@needs_vnni
@FORMS
@pytest.mark.parametrize("name", ALL_QTYPES)
def test_vnni_linear_extreme_codes_and_activations_do_not_saturate(name, form, use_form):
    """The AVX2 form sums u8 x s8 pairs in int16 (maddubs), and a 4-bit block's eight such
    sums before widening: codes at their ends (Q4: 0 and 15; Q8_0: -128 and 127) against
    activations at the block maximum (X = 8191: xh = 63, xl = 127) and its negation (xh =
    -64) reach the largest sums the form allows; wrapping or saturating would show as
    errors far beyond the rounding bound."""
    use_form(form)
    qtype = ALL_QTYPES[name]
    k = 256
    gen = torch.Generator().manual_seed(13)
    raw = random_blocks(qtype, 32, k, gen)
    blocks = raw.view(32, -1, BLOCK_BYTES.get(qtype, 144))
    if qtype == Q8_0:
        blocks[:16, :, 2:] = 0x7F  # +127
        blocks[16:, :, 2:] = 0x80  # -128
    else:
        codes_from = {Q4_0: 2, Q4_1: 4, Q4_K: 16}[qtype]
        blocks[:16, :, codes_from:] = 0xFF  # code 15 everywhere
        blocks[16:, :, codes_from:] = 0x00  # code 0
    x = torch.full((6, k), 3.0)
    x[1] = -3.0
    x[2, ::2] = -3.0  # alternating signs
    x[3] = torch.randn(k, generator=gen).sign() * 5.0
    x[4, 1::2] = 0.25  # the maximum in every other value only
    x[5] = -x[4]
    expected, bound = _expected(x, raw, qtype)
    assert_close_to(native.vnni_linear(x, native.pack_vnni(raw, qtype, k)), expected, bound,
                    f"{name} extreme codes ({form})")


@pytest.mark.skipif(native.vnni_form() != "avx512", reason="needs the AVX512 form here to compare with")
@pytest.mark.parametrize("form", ["avx2", "avx-vnni"])
@pytest.mark.parametrize("int8", [False, True], ids=["14bit", "int8"])
@pytest.mark.parametrize("name", ALL_QTYPES)
def test_vnni_forms_agree(name, int8, form, use_form):
    """The AVX2 forms round the activations as the AVX512 one does and sum the same exact
    integer products per block: Q4_0's and Q8_0's results are bitwise equal; Q4_1 and Q4_K
    differ only by the float32 order of each block's sum of x (their offsets' factor)."""
    qtype = ALL_QTYPES[name]
    gen = torch.Generator().manual_seed(17)
    raw = random_blocks(qtype, 70, 512, gen)
    x = torch.randn(11, 512, generator=gen)
    w = native.pack_vnni(raw, qtype, 512)
    wide = native.vnni_linear(x, w, int8=int8)
    use_form(form)
    narrow = native.vnni_linear(x, w, int8=int8)
    if qtype in (Q4_0, Q8_0):
        assert torch.equal(wide, narrow), f"{name}: the forms' results differ"
    else:
        torch.testing.assert_close(narrow, wide, rtol=1e-5, atol=1e-4, msg=f"{name}: the forms' results differ")


def test_pack_vnni_refuses_what_it_cannot_read():
    raw = random_blocks(Q4_0, 4, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="multiple of their blocks"):
        native.pack_vnni(raw, Q4_0, 48)
    with pytest.raises(ValueError, match="multiple of their blocks"):
        native.pack_vnni(random_blocks(Q4_K, 4, 256, torch.Generator().manual_seed(0)), Q4_K, 128)
    with pytest.raises(ValueError, match="ggml type 14"):
        native.pack_vnni(torch.zeros(4, 210, dtype=torch.uint8), Q6_K, 256)  # Q6_K: read as its Q8_0 rewrite
    with pytest.raises(ValueError, match=r"\[N, 36\] uint8"):
        native.pack_vnni(raw[:, :30], Q4_0, 64)
    with pytest.raises(ValueError, match="uint8"):
        native.pack_vnni(raw.to(torch.int16), Q4_0, 64)
    with pytest.raises(ValueError, match="ggml type 12"):
        native.pack_vnni(raw, 12, 64)  # Q4_K


def test_builds_without_vnni_say_so(portable_lib, monkeypatch):
    """A build for a CPU without AVX512-VNNI or AVX2 packs (the layout is plain C) but refuses
    to multiply, and `vnni_available()` says so before anyone tries."""
    if portable_lib.pd_has_vnni():
        pytest.skip("this compiler targets AVX512-VNNI by default")
    monkeypatch.setattr(native, "kernels", lambda: portable_lib)
    assert not native.vnni_available()
    raw = random_blocks(Q4_1, 16, 32, torch.Generator().manual_seed(0))
    w = native.pack_vnni(raw, Q4_1, 32)
    with pytest.raises(RuntimeError, match="neither AVX512-VNNI nor AVX2"):
        native.vnni_linear(torch.randn(1, 32), w)


def test_avx2_build_has_no_avx512_or_amx(avx2_build):
    """PAGEDLLM_CPU_MAX_ISA=avx2 builds what a Zen 3 gets: the AVX2 paths, the VNNI kernel in its
    AVX2 form, no AMX tiles, no 512-bit attention, and the CPU's flags read the same way."""
    from pagedllm.ops.cpu import features

    assert avx2_build.pd_has_avx2() and native.vnni_form() == "avx2"
    assert not avx2_build.pd_has_amx() and not avx2_build.pd_has_bf16dot() and not avx2_build.pd_has_bf16_kv()
    assert not native.attention_tiles(64, 3), "512-bit attention tiles in an AVX2-only build"
    cpu = features.detect()
    assert not cpu.native_bf16 and not any(f.startswith(("avx512", "amx")) for f in cpu.flags)
