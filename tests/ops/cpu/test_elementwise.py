"""The per-row kernels (csrc/elementwise.c: pd_gather_rows(_bf16), pd_argmax_rows, pd_rms_norm,
pd_silu_mul, pd_rope_neox) through their native.py wrappers, against torch indexing, float64 torch
and the model's own rotary embedding. Every test runs on both builds (conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.ops.cpu import native
from pagedllm.plugins.models.layers import RotaryEmbedding

from kernel_checks import assert_close_to, require_native

require_native()
pytestmark = pytest.mark.usefixtures("build")


# ------------------------------------------------------------------ gather_rows

def test_gather_rows_matches_indexing():
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(50, 4, 6, generator=gen)
    ids = torch.tensor([3, 0, 49, 3, 17])
    got = native.gather_rows(table, ids)
    assert got.shape == (5, 4, 6) and torch.equal(got, table[ids]), "gather_rows differs from table[ids]"
    assert native.gather_rows(table, torch.empty(0, dtype=torch.int64)).shape == (0, 4, 6)


def test_gather_rows_widens_a_bf16_table_exactly():
    gen = torch.Generator().manual_seed(4)
    table = torch.randn(300, 2, 40, generator=gen).bfloat16()
    table[7, 0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    ids = torch.tensor([7, 299, 0, 7, 150] * 40)  # 200 rows: the threaded branch
    got = native.gather_rows(table, ids)
    assert got.dtype == torch.float32 and got.shape == (200, 2, 40)
    assert torch.equal(got.view(torch.int32), table[ids].float().view(torch.int32)), "bf16 rows not widened bit-exactly"
    with pytest.raises(IndexError, match="outside"):
        native.gather_rows(table, torch.tensor([300]))


def test_the_gather_op_returns_the_dtype_asked_for():
    from pagedllm.plugins.cpu_native import ops as cpu_ops

    table, ids = torch.randn(20, 8).bfloat16(), torch.tensor([1, 19, 4])
    assert torch.equal(cpu_ops.gather_rows_bf16(table, ids, torch.float32), table[ids].float())
    assert cpu_ops.gather_rows_bf16(table, ids).dtype == torch.bfloat16, "without a dtype: the table's"
    assert torch.equal(ops.gather_rows(table, ids, torch.float32), table[ids].float())


def test_gather_rows_rejects_bad_ids():
    table = torch.randn(10, 3)
    for bad in ([10], [-1], [2, 11]):
        with pytest.raises(IndexError, match="outside"):
            native.gather_rows(table, torch.tensor(bad))
    with pytest.raises(ValueError, match="ids"):
        native.gather_rows(table, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="ids"):
        native.gather_rows(table, torch.tensor([1], dtype=torch.int32))


# ------------------------------------------------------------------ argmax_rows

@pytest.mark.parametrize("cols", [1, 7, 16, 33, 49152])
def test_argmax_rows_matches_torch_max(cols):
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(40, cols, generator=gen)
    x[1] = float("-inf")  # every value -inf: index 0
    x[2, -1] = float("nan")  # a NaN counts as the maximum
    if cols > 5:
        x[3, 2] = x[3, 5] = 1e30  # a tie: the first
        x[4, 3] = x[4, cols - 1] = float("nan")  # two NaNs: the first
        x[5, cols - 1] = 1e30  # the maximum in the tail past the last 16 columns
        x[6, 1:] = x[6, 0]  # all equal: index 0
    expected = x.max(dim=-1).indices
    got = native.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, expected), \
        f"rows {(got != expected).nonzero().flatten().tolist()} differ from torch's max(dim=-1)"


def test_argmax_rows_reads_rows_apart():
    """Rows `stride(0)` apart (a column slice of a wider tensor) are read in place."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 100, generator=gen)
    x = wide[:, 10:70]
    assert torch.equal(native.argmax_rows(x), x.max(dim=-1).indices)
    with pytest.raises(ValueError, match="contiguous rows"):
        native.argmax_rows(wide.t())


def test_greedy_sampling_takes_the_argmax_op():
    """The sampler's greedy path goes through ops.argmax_rows (which the native kernel
    serves for CPU float32 logits) and agrees with torch."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 300, generator=gen)
    from pagedllm.core.plugins import get_registry
    from pagedllm.core.sampler import _argmax
    impl = get_registry().op_impl("argmax_rows", logits.device, logits.dtype)
    assert impl is not None and impl.name == "cpu_native", "the sampler would not take the native kernel"
    assert torch.equal(_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))


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


@pytest.mark.parametrize("i", [8, 13, 40, 100])
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
    """T = 200: both kernels take their OpenMP paths (silu_mul above T*I = 8192)."""
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
    """Rotates q and k heads of a fused [T, (H + 2 KVH) D] row in place, as ops.rotary_qkv
    calls it, equal to the op's torch reference; the v columns (and anything beside a
    column slice) stay as they were."""
    h, kvh = 4, 2
    gen = torch.Generator().manual_seed(t * 100 + head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, {})
    positions = torch.randint(0, 4096, (t,), generator=gen)
    cos, sin = rope.lookup(positions)  # [T, D/2]
    width, rotated = (h + 2 * kvh) * head_dim, (h + kvh) * head_dim
    if layout == "contiguous":
        wide = torch.randn(t, width, generator=gen) * 3
        qkv = wide
    else:
        wide = torch.randn(t, width + 13, generator=gen) * 3
        qkv = wide[:, 5:5 + width]
        assert qkv.stride(0) == width + 13
    before = wide.clone()
    q, k, _ = ops.rotary_qkv.reference(qkv.clone(), h, kvh, head_dim, cos, sin)
    expected = torch.cat((q, k), dim=1)
    native.rope_neox_(qkv, h + kvh, head_dim, cos, sin)
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
