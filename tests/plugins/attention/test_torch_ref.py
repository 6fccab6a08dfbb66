"""The TORCH reference's fresh-prefill path (plugins/attention/torch_ref.py): a group that
is one request's whole prompt from position 0 attends with SDPA's is_causal instead of
an explicit mask; the result must be the masked computation's, and any group with earlier
context, a sliding window or soft-capping must keep the mask."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm.plugins.attention.torch_ref import TorchBackend


def forward(batch, metadata, **options):
    impl = TorchBackend.impl_cls()(batch.spec, batch.scale, options.get("window"), options.get("soft_cap"))
    return impl.forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), metadata)


def masked_only(metadata):
    """The same metadata with every group on the explicit-mask path."""
    return dataclasses.replace(metadata, groups=[dataclasses.replace(g, fresh_len=None) for g in metadata.groups])


@pytest.mark.parametrize("requests", [[(0, 40)], [(0, 37), (5, 1), (0, 1), (16, 20)], [(0, 2)]])
@pytest.mark.parametrize("options", [{}, {"window": 7}, {"soft_cap": 30.0}])
def test_fresh_prompts_take_is_causal_with_the_masked_result(make_paged_batch, monkeypatch, requests, options):
    batch = make_paged_batch(requests, num_heads=6, num_kv_heads=2, head_size=32)
    metadata = TorchBackend.builder_cls()(batch.spec).build(batch.layout)
    fresh = {g.fresh_len for g in metadata.groups} - {None}
    assert fresh == {new for cached, new in requests if cached == 0 and new > 1}, \
        "only a whole prompt from position 0 (more than one token) is a fresh group"
    want = forward(batch, masked_only(metadata), **options)
    causal_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        causal_calls.append(kwargs.get("is_causal", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    got = forward(batch, metadata, **options)
    assert sum(causal_calls) == (0 if options else len(fresh)), "is_causal where the mask says more, or not taken"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
