"""The Triton grouped GEMM of plugins/moe_triton, interpreted on the CPU (compiled on a GPU):
against the fused_moe torch reference on tiny shapes, including an expert without tokens,
chunked tokens and the alignment it relies on; and the OpImpl never chosen for CPU tensors."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagedllm import ops  # noqa: E402
from pagedllm.plugins.moe_triton import _check, kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def problem(t=5, e=4, k=2, h=32, i=16, seed=0, empty_expert=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.2
    w2 = torch.randn(e, h, i, generator=g) * 0.2
    logits = torch.randn(t, e, generator=g)
    if empty_expert is not None:
        logits[:, empty_expert] = -1e9
    weights, ids = ops.select_experts(logits, k, renormalize=False)
    return [a.to(DEVICE) for a in (x, w13, w2, weights, ids)]


def test_align_pairs_groups_by_expert_and_pads():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    pairs, experts = kernels.align_pairs(ids, 5, block_m=4)
    sentinel = ids.numel()
    assert experts.tolist()[:3] == [0, 2, 3]  # experts 1 and 4 have no pairs, so no block
    blocks = pairs.view(-1, 4).tolist()
    assert blocks[0] == [1, 4, sentinel, sentinel]  # expert 0: pairs (token 0, slot 1), (token 2, slot 0)
    assert blocks[1] == [0, 2, 5, sentinel]
    assert blocks[2] == [3, sentinel, sentinel, sentinel]
    # room for the worst-case padding (a size known without reading the ids), sentinels only
    assert len(blocks) == -(-(6 + 5 * 3) // 4)
    assert all(b == [sentinel] * 4 for b in blocks[3:])


@pytest.mark.parametrize("shape", [dict(), dict(t=3, e=8, k=3, h=48, i=40), dict(t=1, e=4, k=1)])
def test_grouped_gemm_matches_reference(shape):
    x, w13, w2, weights, ids = problem(**shape)
    torch.testing.assert_close(kernels.fused_moe(x, w13, w2, weights, ids),
                               ops.moe._fused_moe(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_expert_without_tokens():
    x, w13, w2, weights, ids = problem(empty_expert=1)
    assert 1 not in ids.tolist()
    torch.testing.assert_close(kernels.fused_moe(x, w13, w2, weights, ids),
                               ops.moe._fused_moe(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_chunked_tokens(monkeypatch):
    x, w13, w2, weights, ids = problem(t=7)
    whole = ops.moe._fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setenv("PAGEDLLM_FUSED_MOE_CHUNK_SIZE", "3")
    torch.testing.assert_close(kernels.fused_moe(x, w13, w2, weights, ids), whole, rtol=1e-4, atol=1e-4)


def test_op_impl_is_offered_but_refuses_the_cpu():
    from pagedllm.core.plugins import get_registry

    assert [i.name for i in get_registry().op_impls["fused_moe"]] == ["moe_triton"]
    assert "CUDA tensors only" in " ".join(_check(torch.device("cpu"), torch.float32))
    assert ops.fused_moe.impl_for(torch.device("cpu"), torch.float32) is None  # the torch reference serves


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_op_chooses_the_kernel_on_cuda():
    impl = ops.fused_moe.impl_for(torch.device("cuda"), torch.bfloat16)
    assert impl is not None and impl.name == "moe_triton"
    x, w13, w2, weights, ids = problem(t=64, e=8, k=2, h=128, i=64)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    torch.testing.assert_close(ops.fused_moe(x, w13, w2, weights, ids).float(),
                               ops.moe._fused_moe(x, w13, w2, weights, ids).float(), rtol=2e-2, atol=2e-2)
