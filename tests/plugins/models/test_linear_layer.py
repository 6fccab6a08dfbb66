"""The Linear layer's gate/up entry point (`Linear.silu_and_mul`): the method's fused kernel
where it has one for the batch, else the layer's output through ops.silu_and_mul."""

from __future__ import annotations

import torch

from pagedllm import ops
from pagedllm.core.contracts import LinearMethod
from pagedllm.plugins.models.layers import Linear, UnquantizedLinearMethod


class _Fused(UnquantizedLinearMethod):
    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def apply_silu_and_mul(self, layer, x, bias):
        self.calls += 1
        return self.answer(x) if self.answer is not None else None


def _gate_up(method):
    layer = Linear(8, [6, 6])
    layer.method = method
    layer.weight.data.copy_(torch.randn(12, 8, generator=torch.Generator().manual_seed(0)))
    return layer


def test_a_method_without_a_fused_kernel_gets_the_product_then_the_activation():
    layer, x = _gate_up(_Fused(None)), torch.randn(5, 8)
    assert torch.equal(layer.silu_and_mul(x), ops.silu_and_mul(layer(x)))
    assert layer.method.calls == 1


def test_a_fused_result_is_returned_as_the_method_gives_it():
    marker = torch.full((5, 6), 7.0)
    layer = _gate_up(_Fused(lambda x: marker))
    assert layer.silu_and_mul(torch.randn(5, 8)) is marker


def test_the_default_method_contract_fuses_nothing():
    layer, x = Linear(8, [6, 6]), torch.randn(3, 8)
    assert LinearMethod.apply_silu_and_mul(layer.method, layer, x, None) is None
    assert layer.silu_and_mul(x).shape == (3, 6)
