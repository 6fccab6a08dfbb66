"""The routed-experts layer of mixture-of-experts models (Qwen2/3-MoE, DeepSeek-V3).

Interface for model plugins (keep it: DeepSeek-V3 and any later MoE model build on it):

    experts = FusedMoE(ctx, num_experts, top_k, hidden_size, intermediate_size, prefix,
                       renormalize=..., scoring="softmax" | "sigmoid",
                       num_expert_group=None, topk_group=None,
                       has_correction_bias=False, routed_scaling_factor=1.0)
    out = experts(x [T, H], router_logits [T, E])   # -> [T, H], routing then the experts

* `prefix` is the sparse block's checkpoint name (`model.layers.3.mlp`), and the model
  registers the FusedMoE as that block's `experts` attribute, so its parameters are
  `<prefix>.experts.w13_weight` etc. The router (`<prefix>.gate`, a plain unquantized
  Linear) and any shared experts belong to the model's block, not to this layer.
* Weights come from `ctx.quant_config.moe_method(f"{prefix}.experts")` or, without a
  quantizer, `UnquantizedMoEMethod` (dense w13 [E, 2I, H], w2 [E, H, I], `ops.fused_moe`).
* Checkpoint names: `FusedMoE.checkpoint_target(name)` maps
  `<prefix>.experts.{e}.{gate_proj,up_proj,down_proj}.<suffix>` (and the stacked forms:
  transformers' `<prefix>.experts.gate_up_proj` / `.down_proj` [E, ...], GGUF's
  `<prefix>.experts.{gate,up,down}_proj.weight` [E, ...]), plus DeepSeek's
  `<prefix>.gate.e_score_correction_bias`, onto (parameter name, (expert, shard)); a
  model's `load_weights` hands that pair to `layers.load_shard`, whose parameter loaders
  take it as their shard argument. Anything else returns None (the model's own mapping).
* A MoE model calls `process_moe_after_loading(self)` at the end of its `load_weights`
  (it refuses a checkpoint that misses an expert); the core then calls the methods'
  `process_after_loading`, as for every linear and embedding method.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedllm import ops
from pagedllm.core.contracts import ModelContext, MoEMethod

# `<prefix>.experts.{e}.{proj}.<suffix>`, expert optional (GGUF stacks experts)
_PER_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?:(?P<expert>\d+)\.)?"
                         r"(?P<proj>gate_proj|up_proj|down_proj|gate_up_proj)\.(?P<suffix>\w+)$")
# transformers >= 5's stacked parameters, no suffix: `<prefix>.experts.gate_up_proj` [E, 2I, H]
_STACKED = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_BIAS = re.compile(r"^(?P<prefix>.+)\.gate\.e_score_correction_bias$")
# checkpoint projection -> (our fused tensor, shard of it)
_PROJ = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "gate_up_proj": ("w13", None), "down_proj": ("w2", None)}


def expert_loader(param: torch.Tensor, loaded: torch.Tensor, where: tuple[int | None, int | None]) -> None:
    """Copy one expert's shard (or every expert's, `expert` None) into a stacked expert
    parameter [E, rows, ...]: shard s of `param.shard_sizes` along dim 1 (None: all rows).
    Values are converted to the parameter's dtype by the copy."""
    expert, shard = where
    target = param.data if expert is None else param.data[expert]
    if shard is not None:
        sizes = param.shard_sizes  # type: ignore[attr-defined]
        dim = 1 if expert is None else 0
        target = target.narrow(dim, sum(sizes[:shard]), sizes[shard])
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"expert {expert} shard {shard}: shape {tuple(loaded.shape)} does not match the "
                         f"parameter's {tuple(target.shape)}")
    target.copy_(loaded)
    param.loaded_parts.add(where)  # type: ignore[attr-defined]


def missing_parts(param: torch.Tensor, num_experts: int) -> list[tuple[int, int]]:
    """(expert, shard) pairs of a stacked expert parameter that no checkpoint tensor filled."""
    parts = param.loaded_parts  # type: ignore[attr-defined]
    return [(e, s) for e in range(num_experts) for s in range(len(param.shard_sizes))  # type: ignore[attr-defined]
            if not {(None, None), (e, None), (None, s), (e, s)} & parts]


def expert_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                     shard_sizes: tuple[int, ...] | None = None) -> nn.Parameter:
    """Register a stacked expert parameter [E, ...] loaded by `expert_loader` (shards of
    `shard_sizes` rows along its second dim: w13's gate and up)."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = expert_loader  # type: ignore[attr-defined]
    p.shard_sizes = shard_sizes or (shape[1],)  # type: ignore[attr-defined]
    p.loaded_parts = set()  # type: ignore[attr-defined]  # (expert, shard) pairs loaded so far
    layer.register_parameter(name, p)
    return p


class UnquantizedMoEMethod(MoEMethod):
    """Dense experts in the compute dtype: w13_weight [E, 2I, H], w2_weight [E, H, I]."""

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, params_dtype):
        expert_parameter(layer, "w13_weight", (num_experts, 2 * intermediate_size, hidden_size), params_dtype,
                         (intermediate_size, intermediate_size))
        expert_parameter(layer, "w2_weight", (num_experts, hidden_size, intermediate_size), params_dtype)

    def apply(self, layer, x, topk_weights, topk_ids):
        return ops.fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation)


class FusedMoE(nn.Module):
    """A layer's routed experts: `forward(x, router_logits)` routes (`ops.select_experts`)
    and runs the chosen experts through its MoEMethod (see the module docstring)."""

    def __init__(self, ctx: ModelContext, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, prefix: str, *, renormalize: bool, scoring: str = "softmax",
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 has_correction_bias: bool = False, routed_scaling_factor: float = 1.0,
                 activation: str = "silu") -> None:
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"{prefix}: top_k {top_k} exceeds the {num_experts} experts")
        self.prefix = f"{prefix}.experts"
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.routing: dict[str, Any] = dict(renormalize=renormalize, scoring=scoring,
                                            num_expert_group=num_expert_group, topk_group=topk_group,
                                            routed_scaling_factor=routed_scaling_factor)
        self.activation = activation
        quant = ctx.quant_config
        method = quant.moe_method(self.prefix) if quant is not None else None
        self.method: MoEMethod = method or UnquantizedMoEMethod()
        self.method.create_weights(self, num_experts, hidden_size, intermediate_size, ctx.dtype)
        if has_correction_bias:  # DeepSeek-V3: added to the scores when choosing experts
            bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            bias.weight_loader = expert_loader  # type: ignore[attr-defined]
            bias.shard_sizes = (num_experts,)  # type: ignore[attr-defined]
            bias.loaded_parts = set()  # type: ignore[attr-defined]
            self.e_score_correction_bias = bias
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.select_experts(router_logits, self.top_k, correction_bias=self.e_score_correction_bias,
                                          **self.routing)
        return self.method.apply(self, x, weights, ids)

    def check_loaded(self) -> None:
        """Refuse a checkpoint that left some expert's tensor unfilled (the model's loader
        sees each stacked parameter as loaded once any expert's tensor arrives)."""
        missing = []
        for name, param in self.named_parameters(recurse=False):
            if not hasattr(param, "loaded_parts") or getattr(param, "optional", False):
                continue
            for e, s in missing_parts(param, self.num_experts):
                if name == "e_score_correction_bias":
                    missing.append(f"{self.prefix.rpartition('.')[0]}.gate.e_score_correction_bias")
                    break
                fused, _, suffix = name.partition("_")
                proj = "down_proj" if fused == "w2" else ("gate_proj", "up_proj")[s]
                missing.append(f"{self.prefix}.{e}.{proj}.{suffix}")
        if missing:
            raise ValueError(f"checkpoint is missing expert weights: {missing[:8]}{' …' if len(missing) > 8 else ''}")

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, tuple[int | None, int | None]] | None:
        """(our parameter name, (expert, shard)) for a checkpoint tensor of routed experts
        or the routing bias; None for any other tensor (see the module docstring)."""
        m = _PER_EXPERT.match(name)
        if m:
            fused, shard = _PROJ[m["proj"]]
            expert = int(m["expert"]) if m["expert"] is not None else None
            return f"{m['prefix']}.experts.{fused}_{m['suffix']}", (expert, shard)
        m = _STACKED.match(name)
        if m:
            fused, shard = _PROJ[m["proj"]]
            return f"{m['prefix']}.experts.{fused}_weight", (None, shard)
        m = _BIAS.match(name)
        if m:
            return f"{m['prefix']}.experts.e_score_correction_bias", (None, None)
        return None


def process_moe_after_loading(model: nn.Module) -> None:
    """Refuse a checkpoint that left any expert's shard unfilled (a stacked parameter looks
    loaded once one expert fills it). The core then calls each method's
    process_after_loading, as for linear layers."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.check_loaded()
