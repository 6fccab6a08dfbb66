"""The FusedMoE layer (pagedllm/plugins/models/moe.py) on its own, as DeepSeek-V3 uses it:
grouped sigmoid routing with a correction bias loaded from the checkpoint name, against
transformers' DeepSeek-V3 router and experts; both checkpoint layouts (per-expert tensors
and transformers' stacked ones) load the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.core.contracts import ModelContext
from pagedllm.plugins.models.layers import load_shard
from pagedllm.plugins.models.moe import FusedMoE, process_moe_after_loading

PREFIX = "model.layers.3.mlp"


def hf_deepseek_moe(seed=0):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Experts,
        DeepseekV3TopkRouter,
    )

    cfg = transformers.DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8,
                                        num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
                                        routed_scaling_factor=2.5)
    torch.manual_seed(seed)
    router, experts = DeepseekV3TopkRouter(cfg), DeepseekV3Experts(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.copy_(torch.randn(8) * 0.5)
        experts.gate_up_proj.normal_(std=0.3)
        experts.down_proj.normal_(std=0.3)
    return router, experts


def ours() -> FusedMoE:
    ctx = ModelContext(hf_config=None, dtype=torch.float32, device=torch.device("cpu"), attention_backend=None)
    return FusedMoE(ctx, 8, 3, 32, 16, PREFIX, renormalize=True, scoring="sigmoid", num_expert_group=4,
                    topk_group=2, has_correction_bias=True, routed_scaling_factor=2.5)


def load(layer: FusedMoE, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(layer.named_parameters(prefix=f"{PREFIX}.experts"))
    for name, tensor in tensors.items():
        target = FusedMoE.checkpoint_target(name)
        assert target is not None, name
        load_shard(params[target[0]], tensor, target[1])
    process_moe_after_loading(layer)
    layer.method.process_after_loading(layer)  # the core's step (worker.process_after_loading)


def per_expert_tensors(router, experts) -> dict[str, torch.Tensor]:
    out = {f"{PREFIX}.gate.e_score_correction_bias": router.e_score_correction_bias.detach()}
    for e in range(8):
        gate, up = experts.gate_up_proj[e].detach().chunk(2)
        out[f"{PREFIX}.experts.{e}.gate_proj.weight"] = gate
        out[f"{PREFIX}.experts.{e}.up_proj.weight"] = up
        out[f"{PREFIX}.experts.{e}.down_proj.weight"] = experts.down_proj[e].detach()
    return out


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_deepseek_routing_and_experts_match_transformers(layout):
    router, experts = hf_deepseek_moe()
    if layout == "stacked":  # transformers >= 5's own parameter names
        tensors = {f"{PREFIX}.experts.gate_up_proj": experts.gate_up_proj.detach(),
                   f"{PREFIX}.experts.down_proj": experts.down_proj.detach(),
                   f"{PREFIX}.gate.e_score_correction_bias": router.e_score_correction_bias.detach()}
    else:
        tensors = per_expert_tensors(router, experts)
    layer = ours()
    load(layer, tensors)
    x = torch.randn(11, 32)
    with torch.no_grad():
        _, weights, ids = router(x)
        ref = experts(x, ids, weights)
        got = layer(x, F.linear(x, router.weight))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the loaded bias takes part: with a zero bias the layer routes differently
    with torch.no_grad():
        layer.e_score_correction_bias.zero_()
        assert not torch.allclose(layer(x, F.linear(x, router.weight)), ref, atol=1e-3)


def test_checkpoint_names():
    assert FusedMoE.checkpoint_target(f"{PREFIX}.experts.12.up_proj.weight") == (
        f"{PREFIX}.experts.w13_weight", (12, 1))
    assert FusedMoE.checkpoint_target(f"{PREFIX}.experts.0.down_proj.weight_scale_inv") == (
        f"{PREFIX}.experts.w2_weight_scale_inv", (0, None))
    assert FusedMoE.checkpoint_target(f"{PREFIX}.experts.gate_proj.weight") == (  # GGUF-style stack
        f"{PREFIX}.experts.w13_weight", (None, 0))
    # shared experts and the router itself are the model's own tensors
    assert FusedMoE.checkpoint_target(f"{PREFIX}.shared_experts.gate_proj.weight") is None
    assert FusedMoE.checkpoint_target(f"{PREFIX}.shared_expert.down_proj.weight") is None
    assert FusedMoE.checkpoint_target(f"{PREFIX}.gate.weight") is None


def test_missing_bias_or_expert_is_refused():
    router, experts = hf_deepseek_moe()
    tensors = per_expert_tensors(router, experts)
    del tensors[f"{PREFIX}.gate.e_score_correction_bias"]
    with pytest.raises(ValueError, match=r"mlp\.gate\.e_score_correction_bias"):
        load(ours(), tensors)
    tensors = per_expert_tensors(router, experts)
    del tensors[f"{PREFIX}.experts.6.down_proj.weight"]
    with pytest.raises(ValueError, match=r"experts\.6\.down_proj\.weight"):
        load(ours(), tensors)
