"""The native routed-experts kernel (csrc/moe.c, native.moe_f32) against ops.fused_moe's
torch reference: odd sizes, experts without tokens, zero-weight pairs (expert
parallelism), gelu, empty batches, and the refusals; plus the op plumbing that hands a
MoE layer's float32 experts to it (pack_moe) and drops the plain copies."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops
from pagedllm.ops import moe
from pagedllm.ops.cpu import dense, native
from tests.ops.test_moe import random_problem

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")


def native_moe(x, w13, w2, weights, ids, activation="silu"):
    return native.moe_f32(x, native.pack_experts(w13), native.pack_experts(w2), weights, ids, activation)


@pytest.mark.parametrize("t,e,k,h,i", [(1, 4, 2, 32, 16), (7, 6, 3, 40, 24), (33, 8, 2, 64, 48),
                                       (130, 8, 1, 17, 9), (5, 3, 3, 16, 8)])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_matches_the_reference(t, e, k, h, i, activation):
    x, w13, w2, weights, ids = random_problem(t, e, k, h, i)
    torch.testing.assert_close(native_moe(x, w13, w2, weights, ids, activation),
                               moe._fused_moe(x, w13, w2, weights, ids, activation), rtol=1e-5, atol=1e-5)


def test_expert_without_tokens_and_zero_weight_pairs():
    x, w13, w2, weights, ids = random_problem(9, 6, 2, 32, 16, empty_expert=2)
    assert 2 not in ids.tolist()
    weights[::2, 1] = 0.0  # another rank's pairs under expert parallelism: skipped, whatever their id
    ids[::2, 1] = 5
    torch.testing.assert_close(native_moe(x, w13, w2, weights, ids), moe._fused_moe(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)
    weights.zero_()
    assert native_moe(x, w13, w2, weights, ids).abs().max() == 0


def test_no_tokens():
    x, w13, w2, weights, ids = random_problem(3, 4, 2, 32, 16)
    out = native_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 32)


def test_refuses_bad_routing_and_shapes():
    x, w13, w2, weights, ids = random_problem(4, 4, 2, 32, 16)
    bad = ids.clone()
    bad[1, 0] = 4
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        native_moe(x, w13, w2, weights, bad)
    with pytest.raises(ValueError, match="does not fit experts"):
        native_moe(x[:, :16], w13, w2, weights, ids)
    with pytest.raises(NotImplementedError, match="relu"):
        native_moe(x, w13, w2, weights, ids, "relu")


def test_pack_moe_picks_the_native_kernel_for_float32_cpu_experts():
    from pagedllm.plugins.cpu_native.ops import PackedExperts

    x, w13, w2, weights, ids = random_problem(6, 4, 2, 32, 16)
    ops.reset()
    packed = ops.pack_moe(w13, w2)
    assert isinstance(packed, PackedExperts) and packed.owns_copy
    torch.testing.assert_close(packed(x, weights, ids, "silu"), moe._fused_moe(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)
    # other dtypes keep the tensors and the fused_moe op
    reference = ops.pack_moe(w13.half(), w2.half())
    assert not reference.owns_copy and reference.kind == "torch"


def test_unquantized_method_drops_the_plain_experts_once_packed():
    from torch import nn

    from pagedllm.plugins.models.moe import UnquantizedMoEMethod

    x, w13, w2, weights, ids = random_problem(6, 4, 2, 32, 16)
    layer, method = nn.Module(), UnquantizedMoEMethod()
    method.create_weights(layer, 4, 32, 16, torch.float32)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    layer.activation = "silu"
    expected = method.apply(layer, x, weights, ids)
    ops.reset()
    method.process_after_loading(layer)
    assert not hasattr(layer, "w13_weight") and not hasattr(layer, "w2_weight")
    torch.testing.assert_close(method.apply(layer, x, weights, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not dense.bf16_available(), reason="no packed bf16 linear here")
def test_bf16_experts_are_packed_once_and_match_the_reference():
    from pagedllm.plugins.cpu_native.ops import PackedExpertsBF16

    x, w13, w2, weights, ids = random_problem(7, 4, 2, 64, 32)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    ops.reset()
    packed = ops.pack_moe(w13, w2)
    assert isinstance(packed, PackedExpertsBF16) and packed.owns_copy
    got = packed(x, weights, ids, "silu")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), moe._fused_moe(x, w13, w2, weights, ids).float(), rtol=2e-2, atol=2e-2)
