"""MoE ops (pagedllm/ops/moe.py): routing against transformers' routers, the fused_moe
reference against a per-token loop and transformers' experts, and the token chunking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.ops import moe


def naive_moe(x, w13, w2, weights, ids):
    """One token and one expert at a time: the definition fused_moe must meet."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def random_problem(t=5, e=4, k=2, h=32, i=16, seed=0, empty_expert=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.2
    w2 = torch.randn(e, h, i, generator=g) * 0.2
    logits = torch.randn(t, e, generator=g)
    if empty_expert is not None:
        logits[:, empty_expert] = -1e9
    weights, ids = ops.select_experts(logits, k, renormalize=True)
    return x, w13, w2, weights, ids


def test_fused_moe_matches_per_token_loop():
    x, w13, w2, weights, ids = random_problem(t=7, e=6, k=3)
    torch.testing.assert_close(ops.fused_moe(x, w13, w2, weights, ids), naive_moe(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_fused_moe_with_an_expert_without_tokens():
    x, w13, w2, weights, ids = random_problem(empty_expert=2)
    assert 2 not in ids.tolist()
    torch.testing.assert_close(ops.fused_moe(x, w13, w2, weights, ids), naive_moe(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_fused_moe_matches_transformers_experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    experts = Qwen3MoeExperts(cfg)
    x, w13, w2, weights, ids = random_problem(t=9)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        ref = experts(x, ids, weights)
    torch.testing.assert_close(ops.fused_moe(x, w13, w2, weights, ids), ref, rtol=1e-5, atol=1e-5)


def test_chunk_size_env_var_splits_tokens(monkeypatch):
    x, w13, w2, weights, ids = random_problem(t=5)
    whole = ops.fused_moe(x, w13, w2, weights, ids)
    calls = []

    def expert(e, rows):
        calls.append(rows.shape[0])
        return F.linear(moe.activation_and_mul(F.linear(rows, w13[e]), "silu"), w2[e])

    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "2")
    assert moe.chunk_size() == 2
    chunked = moe.expert_rows(x, weights, ids, w13.shape[0], expert)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    assert sum(calls) == 5 * 2 and max(calls) <= 2 * 2  # every pair once; at most 2 tokens x k per call
    monkeypatch.setenv("PAGEDLLM_FUSED_MOE_CHUNK_SIZE", "0")
    with pytest.raises(ValueError, match="PAGEDLLM_FUSED_MOE_CHUNK_SIZE"):
        moe.chunk_size()


def same_sets(ids_a, ids_b):
    return [sorted(r) for r in ids_a.tolist()] == [sorted(r) for r in ids_b.tolist()]


def sort_by_id(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_softmax_routing_matches_transformers(arch, norm_topk_prob):
    import transformers

    if arch == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeTopKRouter as Router,
        )
        cfg = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3,
                                          norm_topk_prob=norm_topk_prob)
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import (
            Qwen2MoeTopKRouter as Router,
        )
        cfg = transformers.Qwen2MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3,
                                          norm_topk_prob=norm_topk_prob)
    router = Router(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_()
        h = torch.randn(20, 32)
        logits, ref_w, ref_ids = router(h)
    w, ids = ops.select_experts(logits, 3, renormalize=norm_topk_prob)
    assert w.dtype == torch.float32
    assert same_sets(ids, ref_ids)
    torch.testing.assert_close(sort_by_id(w, ids)[0], sort_by_id(ref_w, ref_ids)[0], rtol=1e-6, atol=1e-6)
    if norm_topk_prob:
        torch.testing.assert_close(w.sum(-1), torch.ones(20))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_grouped_routing_matches_transformers(norm_topk_prob):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3TopkRouter,
    )

    cfg = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(2)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.copy_(torch.randn(16) * 0.5)  # large enough to change choices
        h = torch.randn(40, 32)
        logits, ref_w, ref_ids = router(h)
    w, ids = ops.select_experts(logits, 4, renormalize=norm_topk_prob, scoring="sigmoid", num_expert_group=4,
                                topk_group=2, correction_bias=router.e_score_correction_bias,
                                routed_scaling_factor=2.5)
    assert same_sets(ids, ref_ids)
    torch.testing.assert_close(sort_by_id(w, ids)[0], sort_by_id(ref_w, ref_ids)[0], rtol=1e-6, atol=1e-6)
    # the bias steers the choice: without it some tokens pick other experts
    _, unbiased = ops.select_experts(logits, 4, renormalize=norm_topk_prob, scoring="sigmoid",
                                     num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert not same_sets(unbiased, ids)
    # and every chosen expert lies in one of the token's topk_group groups
    assert all(len({e // 4 for e in row}) <= 2 for row in ids.tolist())
