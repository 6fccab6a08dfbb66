"""The native CPU kernels (plugins/cpu/csrc/cpu_kernels.c) against torch oracles.

Every test runs twice: on the library `native.kernels()` builds for this machine
(-march=native: the AVX2/FMA/F16C path on x86-64 CPUs that have it) and on a portable
build of the same source without -march (the scalar fallback on x86-64). Oracles:
`gguf_dequant.dequantize` for the block layouts (bit-exact), float64 torch for the
arithmetic kernels, and a straightforward float64 gather-then-softmax for paged attention.
"""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from pagedllm.plugins.cpu import native
from pagedllm.plugins.models.layers import RotaryEmbedding
from pagedllm.plugins.quant import gguf_dequant
from pagedllm.plugins.quant.gguf_file import Q4_0, Q4_1, Q4_K, Q8_0

if not native.available():
    pytest.skip("native CPU kernels unavailable here (no C compiler, the build failed, or PAGEDLLM_CPU_KERNELS=0)",
                allow_module_level=True)

QTYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


# ------------------------------------------------------------------ the two builds

@pytest.fixture(scope="session")
def portable_lib(tmp_path_factory):
    """The same source built without -march=native (so without AVX2 on x86-64)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    target = tmp_path_factory.mktemp("portable-kernels") / "cpu_kernels_portable.so"
    mp = pytest.MonkeyPatch()
    mp.setattr(native, "FLAGS", [f for f in native.FLAGS if not f.startswith("-march")])
    try:
        native._build(compiler, target)
    except RuntimeError as exc:
        pytest.fail(f"the portable build of cpu_kernels.c failed: {exc}")
    finally:
        mp.undo()
    lib = ctypes.CDLL(str(target))
    for name, (restype, argtypes) in native._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


# tests about building the library itself run once, not once per build
BUILD_TESTS = {"test_build_is_cached_under_the_cache_dir", "test_build_failures_turn_the_native_path_off"}


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ not in BUILD_TESTS:
        metafunc.parametrize("build", ["built", "portable"], indirect=True)


@pytest.fixture(autouse=True)
def build(request, monkeypatch):
    """Route every wrapper in `native` through one of the two libraries."""
    variant = getattr(request, "param", "built")
    if variant == "portable":
        lib = request.getfixturevalue("portable_lib")
        if lib.pd_has_avx2():
            pytest.skip("this compiler targets AVX2 by default: the portable build is the built one")
        monkeypatch.setattr(native, "kernels", lambda: lib)
    return variant


def test_build_is_cached_under_the_cache_dir(tmp_path, monkeypatch):
    build_kernels = native.kernels.__wrapped__  # the uncached builder behind kernels()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    lib = build_kernels()
    assert lib is not None, "building the kernels into a fresh cache dir failed"
    files = sorted(p.name for p in (tmp_path / "native").iterdir())
    assert len(files) == 1 and files[0].startswith("cpu_kernels-") and files[0].endswith(".so"), \
        f"the cache dir should hold the one built library, no temporaries: {files}"
    assert lib.pd_abi_version() == native.ABI_VERSION
    # a second process would load the cached file: no rebuild
    def no_rebuild(*args):
        raise AssertionError("rebuilt although the library was cached")

    monkeypatch.setattr(native, "_build", no_rebuild)
    assert build_kernels() is not None
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == files


def test_build_failures_turn_the_native_path_off(tmp_path, monkeypatch):
    build_kernels = native.kernels.__wrapped__
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")  # a "compiler" that always fails
    assert build_kernels() is None, "a failed build should leave the torch paths on, not raise"
    assert not any((tmp_path / "native").iterdir()), "a failed build left files behind"
    monkeypatch.delenv("CC")
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", off)
        assert build_kernels() is None, f"PAGEDLLM_CPU_KERNELS={off} should turn the native kernels off"


# ------------------------------------------------------------------ helpers

def random_blocks(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k/32 * block bytes] random ggml blocks whose fp16 scales (and Q4_1 mins) are finite."""
    nb = n * k // 32
    raw = torch.randint(0, 256, (nb, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=gen)
    halves = torch.randn(nb, 2, generator=gen).half()
    raw[:, 0:2] = halves[:, 0:1].contiguous().view(torch.uint8)
    if qtype == Q4_1:
        raw[:, 2:4] = halves[:, 1:2].contiguous().view(torch.uint8)
    return raw.reshape(n, -1)


def set_scale(raw: torch.Tensor, qtype: int, block: int, value: float, field: int = 0) -> None:
    flat = raw.view(-1, BLOCK_BYTES[qtype])
    flat[block, 2 * field:2 * field + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)


def oracle_weights(raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    return gguf_dequant.dequantize(raw, qtype, (n, k))


def assert_close_to(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float, what: str) -> None:
    err = (got.double() - expected.double()).abs()
    bad = err > bound
    assert torch.isfinite(got).all(), f"{what}: non-finite values at {(~torch.isfinite(got)).nonzero()[:5].tolist()}"
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} elements off; first at {idx}: "
                    f"got {got[tuple(idx)].item()!r}, expected {expected[tuple(idx)].item()!r}, "
                    f"max error {err.max().item():.3g}")


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


# ------------------------------------------------------------------ gather_rows

def test_gather_rows_matches_indexing():
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(50, 4, 6, generator=gen)
    ids = torch.tensor([3, 0, 49, 3, 17])
    got = native.gather_rows(table, ids)
    assert got.shape == (5, 4, 6) and torch.equal(got, table[ids]), "gather_rows differs from table[ids]"
    assert native.gather_rows(table, torch.empty(0, dtype=torch.int64)).shape == (0, 4, 6)


def test_gather_rows_rejects_bad_ids():
    table = torch.randn(10, 3)
    for bad in ([10], [-1], [2, 11]):
        with pytest.raises(IndexError, match="outside"):
            native.gather_rows(table, torch.tensor(bad))
    with pytest.raises(ValueError, match="ids"):
        native.gather_rows(table, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="ids"):
        native.gather_rows(table, torch.tensor([1], dtype=torch.int32))


# ------------------------------------------------------------------ rms_norm / silu_mul

def rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("h", [8, 100, 576])
@pytest.mark.parametrize("t", [1, 3, 7])
def test_rms_norm(t, h):
    gen = torch.Generator().manual_seed(t * 1000 + h)
    x = torch.randn(t, h, generator=gen) * 3
    x[0, :] = 0.0  # an all-zero row: eps alone keeps it finite
    weight = torch.randn(h, generator=gen)
    x_before = x.clone()
    got = native.rms_norm(x, weight, 1e-6)
    assert torch.equal(x, x_before), "rms_norm without residual modified x"
    assert_close_to(got, rms_reference(x, weight, 1e-6), 1e-5 * rms_reference(x, weight.abs(), 1e-6).abs() + 1e-6,
                    f"rms_norm T={t} H={h}")


@pytest.mark.parametrize("h", [8, 100, 576])
@pytest.mark.parametrize("t", [1, 3, 7])
def test_rms_norm_with_residual_updates_it_in_place(t, h):
    gen = torch.Generator().manual_seed(t * 1000 + h + 1)
    x = torch.randn(t, h, generator=gen)
    residual = torch.randn(t, h, generator=gen) * 4
    weight = torch.randn(h, generator=gen)
    x_before, summed = x.clone(), x + residual  # one float32 add: the kernel must give exactly this
    residual_ptr = residual.data_ptr()
    got = native.rms_norm(x, weight, 1e-5, residual)
    assert residual.data_ptr() == residual_ptr
    assert torch.equal(residual, summed), "rms_norm did not leave x + residual in `residual`"
    assert torch.equal(x, x_before), "rms_norm with residual modified x"
    expected = rms_reference(summed, weight, 1e-5)
    assert_close_to(got, expected, 1e-5 * rms_reference(summed, weight.abs(), 1e-5).abs() + 1e-6,
                    f"rms_norm(residual) T={t} H={h}")


def test_rms_norm_rejects_non_contiguous_residual():
    x, w = torch.randn(2, 16), torch.randn(16)
    with pytest.raises(ValueError, match="^residual:"):
        native.rms_norm(x, w, 1e-6, torch.randn(16, 2).T)


@pytest.mark.parametrize("i", [8, 13, 100])
@pytest.mark.parametrize("t", [1, 5])
def test_silu_mul(t, i):
    gen = torch.Generator().manual_seed(t * 100 + i)
    x = torch.randn(t, 2 * i, generator=gen) * 4
    extremes = torch.tensor([100.0, -100.0, 88.5, -88.5, 87.0, -87.0, 30.0, -30.0, 0.0, -0.0, 1e-30, -1e-30])
    gate = x[:, :i]  # a view: writes land in x
    for row in range(t):  # extremes in the gates of every row, on vector lanes and in the scalar tail
        gate[row, :min(i, extremes.numel())] = extremes[:i]
        gate[row, -1] = -100.0 if row % 2 else 100.0
    x[:, i:i + 3] = torch.tensor([1e3, -1e3, 50.0])[:min(3, i)]
    x_before = x.clone()
    got = native.silu_mul(x)
    assert torch.equal(x, x_before), "silu_mul modified its input"
    assert got.shape == (t, i)
    assert torch.isfinite(got).all(), f"silu_mul gave non-finite values: {got[~torch.isfinite(got)]}"
    g, u = x.double()[:, :i], x.double()[:, i:]
    expected = F.silu(g) * u
    bound = 1e-5 * expected.abs() + 1e-6
    assert_close_to(got, expected, bound, f"silu_mul T={t} I={i}")


def test_silu_mul_and_rms_norm_on_many_rows():
    """T = 200: both kernels take their OpenMP paths (silu_mul above T*I = 65536)."""
    gen = torch.Generator().manual_seed(200)
    t, i, h = 200, 400, 576
    x = torch.randn(t, 2 * i, generator=gen) * 4
    got = native.silu_mul(x)
    g, u = x.double()[:, :i], x.double()[:, i:]
    expected = F.silu(g) * u
    assert_close_to(got, expected, 1e-5 * expected.abs() + 1e-6, f"silu_mul T={t} I={i}")
    x = torch.randn(t, h, generator=gen) * 3
    weight = torch.randn(h, generator=gen)
    bound = 1e-5 * rms_reference(x, weight.abs(), 1e-6).abs() + 1e-6
    assert_close_to(native.rms_norm(x, weight, 1e-6), rms_reference(x, weight, 1e-6), bound, f"rms_norm T={t} H={h}")
    residual = torch.randn(t, h, generator=gen)
    summed = x + residual
    got = native.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(residual, summed), f"rms_norm T={t} did not leave x + residual in `residual`"
    bound = 1e-5 * rms_reference(summed, weight.abs(), 1e-6).abs() + 1e-6
    assert_close_to(got, rms_reference(summed, weight, 1e-6), bound, f"rms_norm(residual) T={t} H={h}")


# ------------------------------------------------------------------ rope_neox_

@pytest.mark.parametrize("layout", ["contiguous", "column-slice"])
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize("t", [1, 5, 40])  # 40 > 16: the OpenMP path
def test_rope_neox_in_place_on_fused_qkv(t, head_dim, layout):
    """Rotates q and k heads of a fused [T, (H + 2 KVH) D] row in place, as rotate_qkv
    calls it; the v columns (and anything beside a column slice) stay as they were."""
    h, kvh = 4, 2
    gen = torch.Generator().manual_seed(t * 100 + head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, {})
    positions = torch.randint(0, 4096, (t,), generator=gen)
    cos, sin = rope.lookup(positions)  # [T, 1, D/2]
    width, rotated = (h + 2 * kvh) * head_dim, (h + kvh) * head_dim
    if layout == "contiguous":
        wide = torch.randn(t, width, generator=gen) * 3
        qkv = wide
    else:
        wide = torch.randn(t, width + 13, generator=gen) * 3
        qkv = wide[:, 5:5 + width]
        assert qkv.stride(0) == width + 13
    before = wide.clone()
    expected = RotaryEmbedding.apply(qkv[:, :rotated].reshape(t, h + kvh, head_dim), (cos, sin))
    native.rope_neox_(qkv, h + kvh, head_dim, cos.view(t, -1), sin.view(t, -1))
    got = qkv[:, :rotated].reshape(t, h + kvh, head_dim)
    assert_close_to(got, expected, 1e-6, f"rope_neox_ T={t} D={head_dim} {layout}")
    assert torch.equal(qkv[:, rotated:], (before if layout == "contiguous" else before[:, 5:5 + width])[:, rotated:]), \
        f"rope_neox_ T={t} D={head_dim} {layout} changed the v columns"
    if layout == "column-slice":
        assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(wide[:, 5 + width:], before[:, 5 + width:]), \
            f"rope_neox_ T={t} D={head_dim} wrote outside its column slice"


def test_rope_neox_rejects_what_it_cannot_rotate():
    cos = sin = torch.randn(3, 4)
    with pytest.raises(ValueError, match="^x:"):
        native.rope_neox_(torch.randn(3, 16), 3, 8, cos, sin)  # narrower than 3 heads of 8
    with pytest.raises(ValueError, match="^x:"):
        native.rope_neox_(torch.randn(16, 3).T, 2, 8, cos, sin)  # columns not unit-stride
    with pytest.raises(ValueError, match="^x:"):
        native.rope_neox_(torch.randn(3, 16, dtype=torch.float64), 2, 8, cos, sin)
    with pytest.raises(ValueError, match="^cos:"):
        native.rope_neox_(torch.randn(3, 16), 2, 8, torch.randn(4, 3).T, sin)


# ------------------------------------------------------------------ write_kv

def test_write_kv_from_strided_token_rows():
    """k and v as the model passes them: column slices of the fused qkv output."""
    gen = torch.Generator().manual_seed(11)
    t, h, kvh, d, num_blocks, bs = 9, 4, 2, 20, 5, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    assert not k.is_contiguous() and k.stride(0) == (h + 2 * kvh) * d
    key_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    value_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    expected_k.view(-1, kvh, d)[slots] = k
    expected_v.view(-1, kvh, d)[slots] = v
    native.write_kv(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k), "write_kv: keys not at their slots (or other slots changed)"
    assert torch.equal(value_cache, expected_v), "write_kv: values not at their slots (or other slots changed)"


def test_write_kv_rejects_what_it_cannot_copy():
    k = torch.randn(3, 2, 8)
    cache = torch.zeros(2, 16, 2, 8)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="^k:"):
        native.write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), k, cache[0], cache[1], slots)
    with pytest.raises(ValueError, match="^slots:"):
        native.write_kv(k, k, cache[0], cache[1], slots.to(torch.int32))
    with pytest.raises(ValueError, match="^v:"):
        native.write_kv(k, k.double(), cache[0], cache[1], slots)


# ------------------------------------------------------------------ paged_attention

class PagedCase:
    """Requests of (cached tokens, new tokens) over a shuffled paged cache; q rows laid
    out request after request (q a column slice of a wider qkv tensor, like the model's)."""

    def __init__(self, requests, num_heads, num_kv_heads, head_size, block_size, seed):
        gen = torch.Generator().manual_seed(seed)
        self.requests, self.h, self.kvh, self.d, self.bs = requests, num_heads, num_kv_heads, head_size, block_size
        seq_lens = [c + n for c, n in requests]
        blocks_needed = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_needed) + 3
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        poison = pool.pop()  # a NaN block behind every table's spare columns: reading past seq_len shows
        width = max(blocks_needed) + 2
        self.block_tables = torch.full((len(requests), width), poison, dtype=torch.int32)
        for r, nb in enumerate(blocks_needed):
            self.block_tables[r, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.q_lens = [n for _, n in requests]
        self.row_of = [sum(self.q_lens[:r]) for r in range(len(requests))]
        self.num_tokens = sum(self.q_lens)
        qkv = torch.randn(self.num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen)
        self.q = qkv[:, :num_heads * head_size].view(self.num_tokens, num_heads, head_size)
        self.key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
        self.value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
        self.key_cache[poison] = float("nan")
        self.value_cache[poison] = float("nan")

    def run(self, reqs, out, scale, window=0, soft_cap=0.0):
        """native.paged_attention over the requests `reqs` only (in that order)."""
        lens = torch.tensor([self.q_lens[r] for r in reqs], dtype=torch.int32)
        query_start = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        query_start[1:] = torch.cumsum(lens, 0)
        row_start = torch.tensor([self.row_of[r] for r in reqs], dtype=torch.int32)
        seq_lens = self.seq_lens[reqs].contiguous()
        native.paged_attention(self.q, self.key_cache, self.value_cache, self.block_tables[reqs].contiguous(),
                               seq_lens, query_start, row_start, out, scale, window, soft_cap)

    def reference(self, r, scale, window=0, soft_cap=0.0) -> torch.Tensor:
        """float64 attention of request r's query rows: [q_len, H, D]."""
        seq_len, q_len, g = int(self.seq_lens[r]), self.q_lens[r], self.h // self.kvh
        pos = torch.arange(seq_len)
        slots = self.block_tables[r, pos // self.bs].long() * self.bs + pos % self.bs
        k = self.key_cache.reshape(-1, self.kvh, self.d)[slots].double().repeat_interleave(g, dim=1)
        v = self.value_cache.reshape(-1, self.kvh, self.d)[slots].double().repeat_interleave(g, dim=1)
        q = self.q[self.row_of[r]:self.row_of[r] + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = seq_len - q_len + torch.arange(q_len)
        mask = pos[None, :] <= q_pos[:, None]
        if window:
            mask &= pos[None, :] > q_pos[:, None] - window
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def rows(self, r) -> slice:
        return slice(self.row_of[r], self.row_of[r] + self.q_lens[r])


# decodes, a 20-token chunk from position 0, chunks after a cached prefix (one ending on
# a block edge), a first-token decode and a long decode; max seq_len 131 is odd
MIXED = [(37, 1), (0, 20), (50, 9), (0, 1), (130, 1), (16, 16)]
ATTN_OPTIONS = {
    "plain": dict(),
    "window": dict(window=24),
    "window-1": dict(window=1),
    "soft-cap": dict(soft_cap=5.0, sharp=True),
    "window-and-cap": dict(window=40, soft_cap=3.0, sharp=True),
}
# every (group, head size, block size) plain; each window / soft-cap option on three of them
SHAPES = [(g, d, b) for g in (1, 2, 3, 4, 5) for d in (64, 128, 20) for b in (16, 32)]
ATTN_CASES = [pytest.param(*shape, "plain", id=f"G{shape[0]}-D{shape[1]}-B{shape[2]}-plain") for shape in SHAPES] + [
    pytest.param(*shape, option, id=f"G{shape[0]}-D{shape[1]}-B{shape[2]}-{option}")
    for option in ("window", "window-1", "soft-cap", "window-and-cap")
    for shape in ((1, 20, 32), (3, 128, 16), (4, 64, 32))
]


@pytest.mark.parametrize("group, head_size, block_size, option", ATTN_CASES)
def test_paged_attention_matches_float64(group, head_size, block_size, option):
    options = dict(ATTN_OPTIONS[option])
    sharp = options.pop("sharp", False)
    kvh = 2
    case = PagedCase(MIXED, group * kvh, kvh, head_size, block_size, seed=group * 1000 + head_size + block_size)
    # sharp: scale 1 makes raw scores ~sqrt(D), so the soft cap really bends them
    scale = 1.0 if sharp else head_size**-0.5
    out = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run(list(range(len(MIXED))), out, scale, **options)
    for r, (cached, new) in enumerate(MIXED):
        expected = case.reference(r, scale, **options)
        assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(),
                        f"request {r} (cached {cached}, new {new}), G={group} D={head_size} "
                        f"block {block_size} {option}")


@pytest.mark.parametrize("head_size", [80, 8])
def test_paged_attention_head_sizes_around_the_vector_width(head_size):
    """80 = one 64-wide vector pass + a scalar tail; 8 = one vector of keys per dot."""
    case = PagedCase(MIXED, 4, 1, head_size, 16, seed=head_size)
    out = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run(list(range(len(MIXED))), out, head_size**-0.5)
    for r in range(len(MIXED)):
        expected = case.reference(r, head_size**-0.5)
        assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(), f"request {r}, D={head_size}")


@pytest.mark.parametrize("reqs", [[0, 2], [2, 0], [5, 1, 4]], ids=["0-2", "2-0", "5-1-4"])
def test_paged_attention_on_a_subset_of_the_batch(reqs):
    """row_start is not query_start[:-1]: only the chosen requests' rows are written."""
    case = PagedCase(MIXED, 6, 2, 64, 16, seed=5)
    sentinel = 777.0
    out = torch.full((case.num_tokens, case.h, case.d), sentinel)
    case.run(reqs, out, 0.125, window=30)
    for r in range(len(MIXED)):
        if r in reqs:
            expected = case.reference(r, 0.125, window=30)
            assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(),
                            f"request {r} of subset {reqs}")
        else:
            assert (out[case.rows(r)] == sentinel).all(), \
                f"rows of request {r} (not in subset {reqs}) were overwritten"


def test_paged_attention_skips_requests_without_query_rows():
    """A request with q_len 0 in the middle of the list (its running count does not move)."""
    requests = [(20, 3), (40, 0), (0, 5), (9, 1)]
    case = PagedCase(requests, 4, 2, 64, 16, seed=9)
    out = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run([0, 1, 2, 3], out, 0.125)
    for r in (0, 2, 3):
        expected = case.reference(r, 0.125)
        assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(), f"request {r} of {requests}")


def test_paged_attention_rejects_wrong_dtypes():
    case = PagedCase([(3, 2)], 2, 1, 16, 16, seed=1)
    out = torch.empty(case.num_tokens, 2, 16)
    with pytest.raises(ValueError, match="^q:"):
        native.paged_attention(case.q.double(), case.key_cache, case.value_cache, case.block_tables,
                               case.seq_lens, torch.tensor([0, 2], dtype=torch.int32),
                               torch.tensor([0], dtype=torch.int32), out, 0.25, 0, 0.0)
    with pytest.raises(ValueError, match="^block_tables:"):
        native.paged_attention(case.q, case.key_cache, case.value_cache, case.block_tables.long(),
                               case.seq_lens, torch.tensor([0, 2], dtype=torch.int32),
                               torch.tensor([0], dtype=torch.int32), out, 0.25, 0, 0.0)


def test_paged_attention_rejects_bad_lengths_and_layouts():
    case = PagedCase([(3, 2)], 2, 1, 16, 16, seed=2)  # one request: seq_len 5, 2 query rows
    query_start, row_start = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)

    def call(q=case.q, seq_lens=case.seq_lens, out=None, block_tables=case.block_tables):
        out = torch.empty(case.num_tokens, 2, 16) if out is None else out
        native.paged_attention(q, case.key_cache, case.value_cache, block_tables, seq_lens, query_start,
                               row_start, out, 0.25, 0, 0.0)

    call()  # the arguments below differ from these in one thing each
    capacity = case.block_tables.shape[1] * 16
    with pytest.raises(ValueError, match="longer than its block-table row"):
        call(seq_lens=torch.tensor([capacity + 1], dtype=torch.int32))  # would read past the table row
    with pytest.raises(ValueError, match="^block_tables:"):
        call(block_tables=case.block_tables.flatten())  # no row per request
    with pytest.raises(ValueError, match="shorter than its query"):
        call(seq_lens=torch.tensor([1], dtype=torch.int32))  # 2 query rows in a 1-token sequence
    with pytest.raises(ValueError, match="^q:"):
        call(q=case.q.half())
    with pytest.raises(ValueError, match="^q:"):
        call(q=case.q.contiguous().transpose(1, 2).contiguous().transpose(1, 2))  # head_dim not unit-stride
    with pytest.raises(ValueError, match="^q:"):
        call(q=torch.randn(case.num_tokens, 2, 32)[..., :16])  # heads not adjacent within a row
    with pytest.raises(ValueError, match="^out:"):
        call(out=torch.empty(case.num_tokens, 2, 8))
    with pytest.raises(ValueError, match="^out:"):
        call(out=torch.empty(case.num_tokens, 3, 16))
    with pytest.raises(ValueError, match="^out:"):
        call(out=torch.empty(case.num_tokens, 16, 2).transpose(1, 2))  # not contiguous
    with pytest.raises(ValueError, match="^out:"):
        call(out=torch.empty(case.num_tokens, 2, 16, dtype=torch.float64))
