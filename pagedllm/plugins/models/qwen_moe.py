"""Qwen3-MoE and Qwen2-MoE: Qwen3's / Qwen2's attention with a sparse MLP on some layers.

A layer is sparse unless it is in `mlp_only_layers`, when `num_experts` > 0 and
(layer + 1) is a multiple of `decoder_sparse_step` (transformers' rule); other layers keep
the dense Llama MLP of `intermediate_size`. The sparse block is a softmax router
(`mlp.gate`, a plain Linear, never quantized) over `num_experts` experts of
`moe_intermediate_size`, `num_experts_per_tok` per token, renormalized when
`norm_topk_prob`; Qwen2-MoE adds a shared expert MLP (`shared_expert_intermediate_size`)
scaled by sigmoid(`shared_expert_gate`(x)). Experts load through `FusedMoE`'s name
mapping (moe.py), everything else through Llama's.

Over tensor-parallel ranks the router and the shared expert's gate are replicated (every
rank routes every token alike); the routed experts are split by `FusedMoE` (each expert's
intermediate dim, or whole experts with --enable-expert-parallel), which all-reduces its
own output, so the block adds the shared expert's output, whole on every rank (a Llama MLP
whose row-parallel down projection reduces itself, or a replicated one), to a whole sum.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from pagedllm.core.contracts import ModelContext
from pagedllm.plugins.models.layers import Linear
from pagedllm.plugins.models.llama import LlamaAttention, LlamaMLP
from pagedllm.plugins.models.moe import FusedMoE, process_moe_after_loading
from pagedllm.plugins.models.qwen import (
    Qwen2Attention,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)


def num_experts(cfg: Any) -> int:
    """Routed experts per sparse layer (transformers also spells it num_local_experts)."""
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0)


def is_sparse_layer(cfg: Any, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has routed experts (transformers' Qwen-MoE rule)."""
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
            and num_experts(cfg) > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeSparseBlock(nn.Module):
    """Router then routed experts (no shared expert)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"{type(self).__name__}: hidden_act {cfg.hidden_act!r} (silu only)")
        experts = num_experts(cfg)
        self.gate = Linear(cfg.hidden_size, experts, prefix=f"{prefix}.gate", params_dtype=ctx.dtype)
        self.experts = FusedMoE(ctx, experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, prefix, renormalize=bool(cfg.norm_topk_prob))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen2MoeSparseBlock(Qwen3MoeSparseBlock):
    """Router, routed experts, and a shared expert gated per token by a sigmoid."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__(ctx, layer_idx, prefix)
        cfg = ctx.hf_config
        self.shared_expert = LlamaMLP(ctx, layer_idx, f"{prefix}.shared_expert",
                                      intermediate_size=cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, prefix=f"{prefix}.shared_expert_gate",
                                         params_dtype=ctx.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class _MoELoading:
    """What a Llama-shaped MoE model adds: sparse blocks per layer and the experts' names."""

    sparse_block_cls: type[nn.Module]

    def mlp_cls(self, layer_idx: int) -> type[nn.Module]:
        return self.sparse_block_cls if is_sparse_layer(self.context.hf_config, layer_idx) else LlamaMLP

    def _target(self, name: str):
        return FusedMoE.checkpoint_target(name) or super()._target(name)

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        process_moe_after_loading(self)
        return loaded


class Qwen3MoeForCausalLM(_MoELoading, Qwen3ForCausalLM):
    # attention and dense MLPs split as Llama's, the experts by FusedMoE; pipeline stages
    # skip other stages' experts like any other layer's tensors
    supports_parallel = True
    sparse_block_cls = Qwen3MoeSparseBlock


class Qwen2MoeForCausalLM(_MoELoading, Qwen2ForCausalLM):
    supports_parallel = True  # as Qwen3-MoE's (its shared expert is a Llama MLP)
    sparse_block_cls = Qwen2MoeSparseBlock

    @property
    def attention_cls(self) -> type[nn.Module]:  # type: ignore[override]
        """Qwen2-MoE's config says whether q/k/v have a bias (`qkv_bias`, default true)."""
        return Qwen2Attention if getattr(self.context.hf_config, "qkv_bias", True) else LlamaAttention
