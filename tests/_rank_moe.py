"""Helpers for tests/plugins/models/test_moe_parallel.py that spawned ranks import: tiny
MoE layers (FusedMoE alone, the Qwen3-MoE and Qwen2-MoE sparse blocks) built on a rank's
`ParallelState`, fed the full checkpoint tensors through the checkpoint-name path (each
rank keeps its part), and run on the same input."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from pagedllm.core.contracts import ModelContext
from pagedllm.core.parallel import Group, ParallelLayout, ParallelState
from pagedllm.plugins.models.layers import load_shard
from pagedllm.plugins.models.moe import FusedMoE, process_moe_after_loading
from tests._models import held_experts

PREFIX = "model.layers.0.mlp"
NUM_EXPERTS, TOP_K, HIDDEN, INTER, SHARED_INTER = 8, 3, 32, 16, 24


def tiny_config(**overrides: Any) -> SimpleNamespace:
    """The few Qwen-MoE config fields the sparse blocks read."""
    fields = dict(hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=INTER, num_experts=NUM_EXPERTS,
                  num_experts_per_tok=TOP_K, norm_topk_prob=True, hidden_act="silu",
                  shared_expert_intermediate_size=SHARED_INTER)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def make_context(state: ParallelState, quant_config: Any = None, **cfg: Any) -> ModelContext:
    from pagedllm.plugins.attention.torch_ref import TorchBackend

    return ModelContext(hf_config=tiny_config(**cfg), dtype=torch.float32, device=torch.device("cpu"),
                        attention_backend=TorchBackend, quant_config=quant_config, parallel=state)


def fake_state(layout: ParallelLayout, rank: int) -> ParallelState:
    """Rank `rank`'s state of a one-stage `layout` without torch.distributed: enough to build
    and load layers (which call no collective), not to run them."""
    ranks = list(range(layout.world_size))
    return ParallelState(layout, rank, Group(ranks, rank), Group([rank], rank), Group(ranks, rank))


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors of one sparse block: router, experts, DeepSeek's
    correction bias, Qwen2-MoE's shared expert and its gate."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    out = {f"{PREFIX}.gate.weight": rand(NUM_EXPERTS, HIDDEN, std=1.0),
           f"{PREFIX}.gate.e_score_correction_bias": rand(NUM_EXPERTS, std=0.5),
           f"{PREFIX}.shared_expert_gate.weight": rand(1, HIDDEN)}
    for e in range(NUM_EXPERTS):
        for proj, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
            out[f"{PREFIX}.experts.{e}.{proj}.weight"] = rand(*shape)
    for proj, shape in (("gate_proj", (SHARED_INTER, HIDDEN)), ("up_proj", (SHARED_INTER, HIDDEN)),
                        ("down_proj", (HIDDEN, SHARED_INTER))):
        out[f"{PREFIX}.shared_expert.{proj}.weight"] = rand(*shape)
    return out


def expert_stack(tensors: dict[str, torch.Tensor], proj: str) -> torch.Tensor:
    """One projection of every expert stacked along a new dim 0."""
    return torch.stack([tensors[f"{PREFIX}.experts.{e}.{proj}.weight"] for e in range(NUM_EXPERTS)])


def restack(tensors: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """The same experts in another checkpoint layout: "per-expert" (unchanged),
    "transformers" (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) or
    "gguf" (`experts.{gate,up,down}_proj.weight` [E, ...])."""
    if layout == "per-expert":
        return dict(tensors)
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    gate, up, down = (expert_stack(tensors, p) for p in ("gate_proj", "up_proj", "down_proj"))
    if layout == "transformers":
        out[f"{PREFIX}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{PREFIX}.experts.down_proj"] = down
    elif layout == "gguf":
        for proj, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            out[f"{PREFIX}.experts.{proj}.weight"] = t
    else:
        raise ValueError(layout)
    return out


def _target(name: str) -> tuple[str, Any]:
    """Our parameter and shard for a checkpoint name: the experts' mapping, else Llama's
    gate/up fusion (the shared expert), else the name itself."""
    hit = FusedMoE.checkpoint_target(name)
    if hit is not None:
        return hit
    for proj, shard in (("gate_proj", 0), ("up_proj", 1)):
        if f".{proj}." in name:
            return name.replace(proj, "gate_up_proj"), shard
    return name, None


def load(module: nn.Module, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
    """Feed `module` (named `prefix`) every tensor under it, as a model's load_weights
    does, then the post-loading steps (the experts' completeness check, the methods')."""
    params = dict(module.named_parameters(prefix=prefix))
    for name, tensor in tensors.items():
        target, shard = _target(name)
        if target in params:
            load_shard(params[target], tensor, shard)
    process_moe_after_loading(module)
    for sub in module.modules():
        method = getattr(sub, "method", None)
        if method is not None:
            method.process_after_loading(sub)


def deepseek_layer(ctx: ModelContext) -> FusedMoE:
    """FusedMoE as DeepSeek-V3 uses it: grouped sigmoid routing with a correction bias."""
    return FusedMoE(ctx, NUM_EXPERTS, TOP_K, HIDDEN, INTER, PREFIX, renormalize=True, scoring="sigmoid",
                    num_expert_group=4, topk_group=2, has_correction_bias=True, routed_scaling_factor=2.5)


def build_cases(state: ParallelState, tensors: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
    """Every layer under test, built and loaded on this rank (each from another layout)."""
    from pagedllm.plugins.models.qwen_moe import Qwen2MoeSparseBlock, Qwen3MoeSparseBlock

    ctx = make_context(state)
    cases: dict[str, nn.Module] = {}
    layer = deepseek_layer(ctx)
    load(layer, f"{PREFIX}.experts", restack(tensors, "gguf"))
    cases["deepseek-layer"] = layer
    qwen3 = Qwen3MoeSparseBlock(ctx, 0, PREFIX)
    load(qwen3, PREFIX, restack(tensors, "per-expert"))
    cases["qwen3-block"] = qwen3
    qwen2 = Qwen2MoeSparseBlock(ctx, 0, PREFIX)
    load(qwen2, PREFIX, restack(tensors, "transformers"))
    cases["qwen2-block"] = qwen2
    return cases


def run_cases(state: ParallelState, tensors: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, Any]:
    """Each case's output on `x`, and what its experts hold on this rank (w13, w2 and the
    expert split), for the parent to check against the one-rank run and the checkpoint.
    Tensors come back as numpy arrays: a torch tensor crosses run_ranks' queue as a shared
    memory handle, which the parent cannot open once this rank's process has exited."""
    results: dict[str, Any] = {}
    router = tensors[f"{PREFIX}.gate.weight"]
    with torch.no_grad():
        for name, module in build_cases(state, tensors).items():
            experts = module if isinstance(module, FusedMoE) else module.experts
            out = module(x, x @ router.T) if isinstance(module, FusedMoE) else module(x)
            w13, w2 = held_experts(experts)
            params = {n: tuple(p.shape) for n, p in experts.named_parameters()}
            # once packed for the native MoE kernel the plain parameters are gone: the packed copy's shapes
            params.update(w13_weight=tuple(w13.shape), w2_weight=tuple(w2.shape))
            results[name] = dict(out=out.numpy().copy(), w13=w13.numpy().copy(), w2=w2.numpy().copy(),
                                 split=experts.expert_split, params=params)
    return results
