"""The ggml-quantized weight kernels (csrc/quant.c: pd_dequantize, pd_repack,
pd_linear_packed) through native.dequantize / pack / linear / linear_q /
dequantize_rows, against `gguf_dequant.dequantize` (bit-exact for the block layouts)
and float64 matmuls. Every test runs on both builds (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.cpu import native
from pagedllm.plugins.quant import gguf_dequant
from pagedllm.plugins.quant.gguf_file import Q4_0, Q4_1, Q4_K, Q8_0

from kernel_checks import assert_close_to, require_native
from tests._ggml_blocks import BLOCK_BYTES, random_blocks

require_native()
pytestmark = pytest.mark.usefixtures("build")

QTYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}


def set_scale(raw: torch.Tensor, qtype: int, block: int, value: float, field: int = 0) -> None:
    flat = raw.view(-1, BLOCK_BYTES[qtype])
    flat[block, 2 * field:2 * field + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)


def oracle_weights(raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    return gguf_dequant.dequantize(raw, qtype, (n, k))


# ------------------------------------------------------------------ dequantize / linear_q

@pytest.mark.parametrize("name", QTYPES)
def test_dequantize_is_bit_exact(name):
    qtype = QTYPES[name]
    gen = torch.Generator().manual_seed(qtype)
    n, k = 29, 160
    raw = random_blocks(qtype, n, k, gen)
    # edge scales: zero, negative zero, fp16 subnormals, the fp16 extremes
    for block, value in enumerate([0.0, -0.0, 2.0**-24, -(2.0**-20), 6.1e-5, 65504.0, -65504.0, 1.0]):
        set_scale(raw, qtype, block, value)
        if qtype == Q4_1:
            set_scale(raw, qtype, block + 8, value, field=1)
    got = native.dequantize(raw, qtype, n, k)
    expected = oracle_weights(raw, qtype, n, k)
    assert got.shape == (n, k) and got.dtype == torch.float32
    if not torch.equal(got, expected):
        bad = (got != expected).nonzero()[0].tolist()
        pytest.fail(f"{name}: native dequantize differs from gguf_dequant at {bad}: "
                    f"{got[tuple(bad)].item()!r} vs {expected[tuple(bad)].item()!r}")


def block_offsets(raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """[n, k] float64: each weight's block offset m (value = d*code + m): -8d for Q4_0, the
    stored m for Q4_1, 0 for Q8_0."""
    blocks = raw.reshape(-1, BLOCK_BYTES[qtype])
    d = blocks[:, 0:2].contiguous().view(torch.float16).double()
    if qtype == Q4_0:
        m = -8 * d
    elif qtype == Q4_1:
        m = blocks[:, 2:4].contiguous().view(torch.float16).double()
    else:
        m = torch.zeros_like(d)
    return m.reshape(n, k // 32, 1).expand(n, k // 32, 32).reshape(n, k)


def linear_q_bound(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int,
                   floor: float = 1e-30) -> torch.Tensor:
    """1e-5 of the sum of |terms|, the terms split as the kernels may compute them: each
    weight is d*code + m, and the codes and the block offsets m may meet x separately.
    `floor` = 0 makes the bound purely relative (for rows of tiny activations)."""
    w = oracle_weights(raw, qtype, n, k).double()
    m = block_offsets(raw, qtype, n, k)
    return 1e-5 * (x.double().abs() @ ((w - m).abs() + m.abs()).T) + floor


@pytest.mark.parametrize("k", [32, 96, 576])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 33])
@pytest.mark.parametrize("name", QTYPES)
def test_linear_q_matches_dequantized_matmul(name, m, k):
    qtype, n = QTYPES[name], 37
    gen = torch.Generator().manual_seed(1000 * qtype + 10 * m + k)
    raw = random_blocks(qtype, n, k, gen)
    # blocks of x at magnitudes 1e-3 .. 1e3 within a row: rounding x to a fixed point with
    # one scale per row must keep enough bits for the small blocks
    magnitude = 10.0 ** torch.randint(-3, 4, (m, k // 32, 1), generator=gen).float()
    x = (torch.randn(m, k // 32, 32, generator=gen) * magnitude).reshape(m, k)
    expected = x.double() @ oracle_weights(raw, qtype, n, k).double().T
    got = native.linear_q(x, raw, qtype)
    assert got.shape == (m, n) and got.dtype == torch.float32, f"{name}: output {got.shape} {got.dtype}"
    assert_close_to(got, expected, linear_q_bound(x, raw, qtype, n, k), f"{name} linear_q M={m} K={k} N={n}")


@pytest.mark.parametrize("m", [1, 3, 13])
@pytest.mark.parametrize("name", QTYPES)
def test_linear_q_into_a_column_slice(name, m):
    qtype, n, k = QTYPES[name], 37, 96
    gen = torch.Generator().manual_seed(7 * qtype + m)
    raw = random_blocks(qtype, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    wide = torch.full((m, n + 11), 123.25)
    out = wide[:, 5:5 + n]
    result = native.linear_q(x, raw, qtype, out=out)
    assert result.data_ptr() == out.data_ptr(), "linear_q did not return the `out` it was given"
    expected = x.double() @ oracle_weights(raw, qtype, n, k).double().T
    assert_close_to(wide[:, 5:5 + n], expected, linear_q_bound(x, raw, qtype, n, k),
                    f"{name} linear_q into out[:, 5:{5 + n}]")
    assert (wide[:, :5] == 123.25).all() and (wide[:, 5 + n:] == 123.25).all(), \
        f"{name} linear_q wrote outside its column slice"


def test_linear_q_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(3)
    raw = random_blocks(Q8_0, 4, 64, gen)
    x = torch.randn(2, 64, generator=gen)
    with pytest.raises(ValueError, match=f"ggml type {Q4_K}"):
        native.linear_q(x, raw, Q4_K)  # a ggml type the kernel does not read
    with pytest.raises(ValueError, match="K=48"):
        native.linear_q(torch.randn(2, 48), raw, Q8_0)  # K not a multiple of 32
    with pytest.raises(ValueError, match="^out:"):
        native.linear_q(x, raw, Q8_0, out=torch.empty(2, 5))  # wrong output shape
    with pytest.raises(ValueError, match="^out:"):
        native.linear_q(x, raw, Q8_0, out=torch.empty(4, 2).T)  # columns not unit-stride
    with pytest.raises(ValueError, match="^x:"):
        native.linear_q(torch.randn(64, 2).T, raw, Q8_0)  # x not contiguous
    with pytest.raises(ValueError, match="^raw:"):
        native.linear_q(x, raw.to(torch.int8), Q8_0)
    with pytest.raises(ValueError, match=f"ggml type {Q4_K}"):
        native.dequantize(raw, Q4_K, 4, 64)


# ------------------------------------------------------------------ pack / linear / dequantize_rows

def code_bytes_of(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """[n, k/32 * (16 | 32)] the code bytes of raw blocks, block after block (what pack keeps)."""
    n = raw.shape[0]
    start = {Q4_0: 2, Q4_1: 4, Q8_0: 2}[qtype]
    return raw.reshape(-1, BLOCK_BYTES[qtype])[:, start:].reshape(n, -1)


def fp16_field(raw: torch.Tensor, qtype: int, field: int) -> torch.Tensor:
    """[n, k/32] float32: the fp16 at bytes 2*field of every block (0: d, 1: Q4_1's m)."""
    blocks = raw.reshape(-1, BLOCK_BYTES[qtype])
    return blocks[:, 2 * field:2 * field + 2].contiguous().view(torch.float16).float().reshape(raw.shape[0], -1)


@pytest.mark.parametrize("name", QTYPES)
def test_pack_layout_and_nbytes(name):
    qtype, n, k = QTYPES[name], 11, 160
    gen = torch.Generator().manual_seed(50 + qtype)
    raw = random_blocks(qtype, n, k, gen)
    set_scale(raw, qtype, 0, 2.0**-24)  # an fp16 subnormal scale
    set_scale(raw, qtype, 1, -65504.0)
    packed = native.pack(raw, qtype, k)
    nblocks, cb = k // 32, 32 if qtype == Q8_0 else 16
    assert (packed.qtype, packed.n, packed.k) == (qtype, n, k), f"{name}: {packed.qtype, packed.n, packed.k}"
    assert packed.codes.shape == (n, nblocks * cb) and packed.codes.dtype == torch.uint8, \
        f"{name}: codes {packed.codes.shape} {packed.codes.dtype}"
    assert torch.equal(packed.codes, code_bytes_of(raw, qtype)), f"{name}: packed codes are not the blocks' code bytes"
    d = fp16_field(raw, qtype, 0)
    assert packed.d.dtype == torch.float32 and torch.equal(packed.d, d), f"{name}: packed d is not the fp16 scales"
    if qtype == Q8_0:
        assert packed.m.numel() == 0, f"Q8_0 has no offsets, packed m has {packed.m.numel()}"
    else:
        m = -8 * d if qtype == Q4_0 else fp16_field(raw, qtype, 1)
        assert packed.m.shape == (n, nblocks) and torch.equal(packed.m, m), f"{name}: packed m is not the offsets"
    per_block = cb + 4 + (0 if qtype == Q8_0 else 4)  # codes, float32 d, float32 m
    assert packed.nbytes == n * nblocks * per_block, \
        f"{name}: nbytes {packed.nbytes}, expected {n * nblocks * per_block}"


@pytest.mark.parametrize("name", QTYPES)
def test_pack_reads_a_non_contiguous_raw(name):
    """A column slice of a wider byte tensor packs like its contiguous copy (the copy
    must outlive the C call: once it was a temporary freed before pd_repack read it)."""
    qtype, n, k = QTYPES[name], 4, 64
    gen = torch.Generator().manual_seed(55 + qtype)
    raw = random_blocks(qtype, n, k, gen)
    wide = torch.randint(0, 256, (n, raw.shape[1] + 7), dtype=torch.uint8, generator=gen)
    wide[:, 3:3 + raw.shape[1]] = raw
    view = wide[:, 3:3 + raw.shape[1]]
    assert not view.is_contiguous()
    packed, expected = native.pack(view, qtype, k), native.pack(raw, qtype, k)
    assert torch.equal(packed.d, expected.d), f"{name}: scales packed from a strided view differ: " \
        f"{packed.d[0].tolist()} vs {expected.d[0].tolist()}"
    assert torch.equal(packed.codes, expected.codes), f"{name}: codes packed from a strided view differ"
    assert torch.equal(packed.m, expected.m), f"{name}: offsets packed from a strided view differ"


@pytest.mark.parametrize("name", QTYPES)
def test_pack_once_then_linear(name):
    """One pack serves every batch size (the 8/4/2/1-row kernels) and `out` slices, gives
    exactly what linear_q gives, and no longer depends on the raw bytes it came from."""
    qtype, n, k = QTYPES[name], 37, 96
    gen = torch.Generator().manual_seed(60 + qtype)
    raw = random_blocks(qtype, n, k, gen)
    raw_copy = raw.clone()
    packed = native.pack(raw, qtype, k)
    raw.zero_()  # pack copied what it needs
    w = oracle_weights(raw_copy, qtype, n, k).double()
    for m in (1, 4, 7, 13, 33):
        x = torch.randn(m, k, generator=gen) * 2
        got = native.linear(x, packed)
        assert got.shape == (m, n) and got.dtype == torch.float32, f"{name} M={m}: output {got.shape} {got.dtype}"
        again = native.linear_q(x, raw_copy, qtype)
        if not torch.equal(got, again):
            pytest.fail(f"{name} M={m}: linear(pack(raw)) differs from linear_q(raw) by up to "
                        f"{(got - again).abs().max().item():.3g}")
        assert_close_to(got, x.double() @ w.T, linear_q_bound(x, raw_copy, qtype, n, k), f"{name} linear M={m}")
        wide = torch.full((m, n + 6), -5.5)
        result = native.linear(x, packed, out=wide[:, 2:2 + n])
        assert result.data_ptr() == wide[:, 2:].data_ptr(), "linear did not return the `out` it was given"
        assert torch.equal(wide[:, 2:2 + n], got), f"{name} M={m}: linear into a column slice differs"
        assert (wide[:, :2] == -5.5).all() and (wide[:, 2 + n:] == -5.5).all(), \
            f"{name} M={m}: linear wrote outside its column slice"


@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize("m", [1, 5, 6, 13, 97, 200])  # partial 6-row tiles; more than one 96-row block
@pytest.mark.parametrize("n, k", [(37, 96), (16, 1600)])  # a partial 16-column panel; K over one 1536 block
def test_gemm_path_equals_the_dequantized_weights(name, m, n, k):
    """pd_linear_packed_gemm (panels decoded into the float32 GEMM) gives the product with
    the dequantized weights to float32 accuracy, into `out` column slices too."""
    qtype = QTYPES[name]
    gen = torch.Generator().manual_seed(90 + qtype + m + n)
    raw = random_blocks(qtype, n, k, gen)
    packed = native.pack(raw, qtype, k)
    w = oracle_weights(raw, qtype, n, k).double()
    x = torch.randn(m, k, generator=gen) * 2
    got = native.linear(x, packed, gemm=True)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert_close_to(got, x.double() @ w.T, linear_q_bound(x, raw, qtype, n, k), f"{name} gemm M={m} N={n} K={k}")
    wide = torch.full((m, n + 6), -5.5)
    native.linear(x, packed, out=wide[:, 2:2 + n], gemm=True)
    assert torch.equal(wide[:, 2:2 + n], got), f"{name} M={m}: gemm into a column slice differs"
    assert (wide[:, :2] == -5.5).all() and (wide[:, 2 + n:] == -5.5).all(), f"{name}: gemm wrote outside its slice"


def test_pack_and_linear_reject_bad_arguments():
    gen = torch.Generator().manual_seed(4)
    raw = random_blocks(Q8_0, 4, 32, gen)  # [4, 34]: rows of K=32
    with pytest.raises(ValueError, match=r"^raw: expected \[N, 68\]"):
        native.pack(raw, Q8_0, 64)  # the row size says K=32, not 64
    with pytest.raises(ValueError, match=r"^raw: expected \[N, 18\]"):
        native.pack(raw, Q4_0, 32)  # Q8_0 rows read as Q4_0
    with pytest.raises(ValueError, match="^raw:"):
        native.pack(raw.reshape(-1), Q8_0, 32)  # not [N, bytes]
    with pytest.raises(ValueError, match="^raw:"):
        native.pack(raw.view(torch.int8), Q8_0, 32)
    with pytest.raises(ValueError, match=f"ggml type {Q4_K}"):
        native.pack(raw, Q4_K, 32)
    with pytest.raises(ValueError, match="K=48"):
        native.pack(raw, Q8_0, 48)  # K not a multiple of 32
    packed = native.pack(raw, Q8_0, 32)
    with pytest.raises(ValueError, match="x has 64 columns, the weight 32"):
        native.linear(torch.randn(2, 64), packed)
    with pytest.raises(ValueError, match="^x:"):
        native.linear(torch.randn(2, 32, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="^out:"):
        native.linear(torch.randn(2, 32), packed, out=torch.empty(2, 4, dtype=torch.float64))


# rows of x at one magnitude each: x is rounded to integers with one scale per row, and
# that scale (and its inverse) must stay a normal float for tiny and huge rows alike
ROW_SCALES = [1e-36, 1e-30, 1e-20, 1.0, 1e20, 1e30, 0.0, "mixed"]


def rows_at_magnitudes(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen)
    for r in range(m):
        scale = ROW_SCALES[r % len(ROW_SCALES)]
        if scale == "mixed":  # 1e-30 and 1.0 in one row, alternating blocks
            x[r].view(-1, 32)[::2] *= 1e-30
        else:
            x[r] *= scale
    return x


@pytest.mark.parametrize("m", [8, 64])  # 64 x 576 crosses quantize_rows_i16's OpenMP threshold
@pytest.mark.parametrize("name", QTYPES)
def test_linear_rows_of_any_magnitude(name, m):
    qtype, n, k = QTYPES[name], 19, 576
    gen = torch.Generator().manual_seed(70 + qtype + m)
    raw = random_blocks(qtype, n, k, gen)
    x = rows_at_magnitudes(m, k, gen)
    got = native.linear(x, native.pack(raw, qtype, k))
    expected = x.double() @ oracle_weights(raw, qtype, n, k).double().T
    bound = linear_q_bound(x, raw, qtype, n, k, floor=0.0)  # relative: the zero row must give exact zeros
    for r in range(m):
        assert_close_to(got[r], expected[r], bound[r],
                        f"{name} linear, row {r} at scale {ROW_SCALES[r % len(ROW_SCALES)]} (M={m})")


@pytest.mark.parametrize("name", QTYPES)
def test_linear_rows_of_subnormal_activations(name):
    """Rows whose largest |x| is below 2^-128 (all subnormal floats: 2^-e must not overflow)."""
    qtype, n, k = QTYPES[name], 5, 64
    gen = torch.Generator().manual_seed(80 + qtype)
    raw = random_blocks(qtype, n, k, gen)
    x = torch.randn(2, k, generator=gen)
    x = x / x.abs().amax(dim=1, keepdim=True) * torch.tensor([[2.0**-129], [2.0**-140]])
    got = native.linear(x, native.pack(raw, qtype, k))
    expected = x.double() @ oracle_weights(raw, qtype, n, k).double().T
    # float32 products of subnormals keep fewer bits: 2^-149 absolute per term
    bound = linear_q_bound(x, raw, qtype, n, k, floor=0.0) + k * 2.0**-149
    assert_close_to(got, expected, bound, f"{name} linear on rows of max|x| 2^-129 and 2^-140")


@pytest.mark.parametrize("name", QTYPES)
def test_dequantize_rows_is_bit_exact(name):
    """The embedding lookup: any rows, repeated and out of order, as gguf_dequant gives them."""
    qtype, n, k = QTYPES[name], 29, 160
    gen = torch.Generator().manual_seed(90 + qtype)
    raw = random_blocks(qtype, n, k, gen)
    for block, value in enumerate([0.0, -0.0, 2.0**-24, -(2.0**-20), 6.1e-5, 65504.0, -65504.0, 1.0]):
        set_scale(raw, qtype, block * 5, value)  # blocks 0, 5, ... 35: rows 0, 1, 2, ..., 7
        if qtype == Q4_1:
            set_scale(raw, qtype, block * 5 + 1, -value, field=1)
    packed = native.pack(raw, qtype, k)
    for ids in ([28, 0, 5, 5, 3, 28, 1, 7, 2, 6, 4], [17], [], list(range(n))[::-1]):
        ids_t = torch.tensor(ids, dtype=torch.int64)
        got = native.dequantize_rows(packed, ids_t)
        expected = oracle_weights(raw[ids_t], qtype, len(ids), k)
        assert got.shape == (len(ids), k) and got.dtype == torch.float32, f"{name} ids {ids}: {got.shape} {got.dtype}"
        if not torch.equal(got, expected):
            bad = (got != expected).nonzero()[0].tolist()
            pytest.fail(f"{name}: dequantize_rows(ids={ids}) differs from gguf_dequant at {bad}: "
                        f"{got[tuple(bad)].item()!r} vs {expected[tuple(bad)].item()!r}")
