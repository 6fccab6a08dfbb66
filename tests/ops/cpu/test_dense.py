"""Packed-weight float32 linears (pagedllm/ops/cpu/dense.py: the native GEMM, else
oneDNN's) and the layers that use them. Every test runs with each packer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.ops.cpu import dense, native
from pagedllm.plugins.models.layers import Linear, UnquantizedEmbeddingMethod, VocabEmbedding

pytestmark = pytest.mark.skipif(not dense.available(), reason="neither the native kernels nor oneDNN here")


@pytest.fixture(autouse=True, params=["native", "onednn"])
def packer(request, monkeypatch):
    if request.param == "native" and not native.available():
        pytest.skip("native kernels not built here")
    if request.param == "onednn":
        if not dense._onednn_available():
            pytest.skip("torch has no oneDNN packed linear here")
        monkeypatch.setattr(native, "available", lambda: False)
    return request.param


def expected_type(packer):
    return native.DenseWeight if packer == "native" else torch.Tensor


@pytest.mark.parametrize("rows", [1, 9, 64, 300])
def test_packed_linear_matches_f_linear(rows, packer):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    packed = dense.prepack(w)
    assert isinstance(packed, expected_type(packer)), f"a float32 CPU weight was not packed by {packer}"
    torch.testing.assert_close(dense.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense.linear(x, packed, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = x.view(1, rows, 64)  # leading dims pass through
    assert dense.linear(x3, packed, None).shape == (1, rows, 96)


def test_prepack_declines_what_it_cannot_pack(monkeypatch):
    assert dense.prepack(torch.randn(8, 8, dtype=torch.bfloat16)) is None, "bf16 weights must stay plain"
    assert dense.prepack(torch.randn(8)) is None, "a 1-D tensor is no linear weight"
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert dense.prepack(torch.randn(8, 8)) is None, "PAGEDLLM_CPU_KERNELS=0 must turn packing off"


def test_linear_layer_swaps_its_weight_for_the_packed_copy():
    layer = Linear(64, [32, 16], bias=True)
    w = torch.randn(48, 64)
    layer.weight.data.copy_(w)
    layer.bias.data.normal_()
    expected = F.linear(torch.ones(3, 64), w, layer.bias)
    layer.method.process_after_loading(layer)
    assert "weight" not in dict(layer.named_parameters()), "the plain weight should be replaced, not duplicated"
    torch.testing.assert_close(layer(torch.ones(3, 64)), expected, rtol=1e-5, atol=1e-5)


def test_embedding_keeps_its_table_and_packs_for_logits():
    emb = VocabEmbedding(100, 64, torch.float32)
    assert isinstance(emb.method, UnquantizedEmbeddingMethod)
    emb.weight.data.normal_()
    emb.method.process_after_loading(emb)
    ids = torch.tensor([3, 99, 0])
    torch.testing.assert_close(emb(ids), emb.weight[ids])
    x = torch.randn(5, 64)
    torch.testing.assert_close(emb.logits(x), x @ emb.weight.T, rtol=1e-5, atol=1e-5)
