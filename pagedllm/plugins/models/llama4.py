"""Llama 4, text side (`Llama4ForCausalLM`, config `Llama4TextConfig`, model_type llama4_text).

Llama's pre-norm skeleton with these differences, as transformers 5 implements them:
- layers alternate dense and sparse feed-forwards: `moe_layers` (default every
  `interleave_moe_layer_step`-th layer) hold a MoE block, the others a dense SwiGLU MLP of
  `intermediate_size_mlp`; a MoE block is a router over `num_local_experts` experts of
  `intermediate_size`, top `num_experts_per_tok` by logit, each chosen expert fed the token
  *scaled by* sigmoid(its logit) (the experts are nonlinear, so this is not the same as
  weighting their outputs), plus an always-on shared expert of `intermediate_size`;
- `no_rope_layers[i]` = 1 marks a RoPE layer (by default every `no_rope_layer_interval`-th
  layer has none). RoPE layers attend in chunks (`layer_types` "chunked_attention",
  `attention_chunk_size` C: a query at p sees keys floor(p / C) * C .. p) and, with
  `use_qk_norm`, L2-normalize q and k per head after the rotation; the NoPE layers attend
  globally and, with `attn_temperature_tuning`, scale q by
  1 + attn_scale * log1p(floor((p + 1) / floor_scale));
- the rotation pairs adjacent elements (2i, 2i + 1) as complex numbers (transformers'
  `apply_rotary_emb`), not the halves Llama rotates, so it is done here rather than by
  `ops.rotary_qkv`; the cos/sin tables are the shared rope.py ones (llama3 scaling included);
- the checkpoint says `feed_forward` where Llama says `mlp`, and stacks each MoE layer's
  experts as `experts.gate_up_proj` [E, H, 2I] and `experts.down_proj` [E, I, H]: the
  transposes of FusedMoE's w13 [E, 2I, H] and w2 [E, H, I], transposed at load.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator

import torch
from torch import nn

from pagedllm import ops
from pagedllm.core.contracts import AttentionContext, KVCacheSpec, ModelContext
from pagedllm.plugins.models.layers import Attention, Linear, attention_projections
from pagedllm.plugins.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    llama_kv_cache_spec,
)
from pagedllm.plugins.models.moe import FusedMoE, process_moe_after_loading

CHUNKED, FULL = "chunked_attention", "full_attention"
# transformers' stacked expert tensors (no ".weight" suffix), in its [E, in, out] layout
_STACKED_EXPERTS = re.compile(r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$")


# ---------------------------------------------------------------- config facts

def uses_rope(cfg: Any) -> list[bool]:
    """Per layer: whether it rotates q and k (transformers' `no_rope_layers`, 1 = RoPE;
    derived from `no_rope_layer_interval` when absent, as its config does)."""
    flags = getattr(cfg, "no_rope_layers", None)
    if not flags:
        interval = int(getattr(cfg, "no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(cfg.num_hidden_layers)]
    if len(flags) < cfg.num_hidden_layers:
        raise ValueError(f"no_rope_layers names {len(flags)} layers, the model has {cfg.num_hidden_layers}")
    return [bool(f) for f in flags[:cfg.num_hidden_layers]]


def layer_types(cfg: Any) -> list[str]:
    """Per layer: "chunked_attention" or "full_attention" (the config's `layer_types`, else
    RoPE layers chunked when `attention_chunk_size` is set, as transformers derives them)."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        chunk = getattr(cfg, "attention_chunk_size", None)
        types = [CHUNKED if rope and chunk is not None else FULL for rope in uses_rope(cfg)]
    types = list(types)
    if len(types) != cfg.num_hidden_layers or set(types) - {CHUNKED, FULL}:
        raise ValueError(f"layer_types must name {cfg.num_hidden_layers} layers, each {CHUNKED!r} or {FULL!r}; "
                         f"got {types}")
    if CHUNKED in types and not getattr(cfg, "attention_chunk_size", None):
        raise ValueError("layer_types marks chunked_attention layers but the config sets no attention_chunk_size")
    return types


def moe_layers(cfg: Any) -> set[int]:
    """The layers with a MoE block: `moe_layers`, else every `interleave_moe_layer_step`-th."""
    layers = getattr(cfg, "moe_layers", None)
    if layers is None:
        step = int(getattr(cfg, "interleave_moe_layer_step", 1) or 1)
        layers = range(step - 1, cfg.num_hidden_layers, step)
    return set(layers)


def llama4_kv_cache_spec(cfg: Any) -> KVCacheSpec:
    """Llama's head facts plus each layer's attention chunk (None on the global layers)."""
    types = layer_types(cfg)
    chunks = tuple(int(cfg.attention_chunk_size) if t == CHUNKED else None for t in types) if CHUNKED in types else ()
    return dataclasses.replace(llama_kv_cache_spec(cfg), attention_chunks=chunks)


# ---------------------------------------------------------------- attention

def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by position, treating elements (2i, 2i + 1) as one complex
    number multiplied by cos_i + i sin_i (cos, sin: float32 [T, D/2]); float32 inside."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)


class Llama4Attention(nn.Module):
    """qkv -> (RoPE layers: pairwise rotary, L2 q/k norm; NoPE layers: temperature-scaled
    q) -> chunked or global attention -> o_proj."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        spec = llama4_kv_cache_spec(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        # the projections split the model's heads; this layer computes with the rank's
        self.qkv_proj, self.o_proj = attention_projections(ctx, spec.num_heads, spec.num_kv_heads, spec.head_size,
                                                           prefix, bias, bias)
        spec = spec.for_tensor_parallel(ctx.parallel.tp.size)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.use_rope = uses_rope(cfg)[layer_idx]
        self.qk_norm = bool(getattr(cfg, "use_qk_norm", True)) and self.use_rope
        self.temperature_tuning = bool(getattr(cfg, "attn_temperature_tuning", True)) and not self.use_rope
        self.eps = cfg.rms_norm_eps
        # the L2 norm is an RMS norm without a learnt scale
        self.register_buffer("unit", torch.ones(self.head_dim, dtype=torch.float32), persistent=False)
        self.attn = Attention(ctx, layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5, attention_chunk_size=spec.chunk(layer_idx))
        self.sizes = (q_size, kv_size, kv_size)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], x: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        cos, sin, q_scale = rope
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        if self.qk_norm:  # rows of one head each (ops.rms_norm takes [rows, size])
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.unit, self.eps).view_as(q)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.unit, self.eps).view_as(k)
        if self.temperature_tuning:
            q = (q * q_scale[:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, attn))


# ---------------------------------------------------------------- feed-forward

class Llama4DenseMLP(LlamaMLP):
    """The dense layers' SwiGLU MLP, of `intermediate_size_mlp`."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__(ctx, layer_idx, prefix, intermediate_size=ctx.hf_config.intermediate_size_mlp)


class Llama4MoE(nn.Module):
    """Router, routed experts fed score-scaled inputs, and the shared expert.

    Over tensor-parallel ranks the router is replicated (every rank routes every token
    alike), the experts are split by `FusedMoE` (each expert's intermediate slice, or whole
    experts under --enable-expert-parallel) and the shared expert is a column/row MLP that
    reduces itself; the routed copies are summed per token on each rank first, so the
    experts' partial outputs cost one all-reduce of [T, H], not of [T x k, H]."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"{type(self).__name__}: hidden_act {cfg.hidden_act!r} (silu only)")
        self.top_k = int(cfg.num_experts_per_tok)
        self.router = Linear(cfg.hidden_size, cfg.num_local_experts, prefix=f"{prefix}.router",
                             params_dtype=ctx.dtype)
        # routing is done here (see forward), so FusedMoE's own routing options are unused
        self.experts = FusedMoE(ctx, cfg.num_local_experts, self.top_k, cfg.hidden_size, cfg.intermediate_size,
                                prefix, renormalize=False, scoring="sigmoid", reduce_results=False)
        self.shared_expert = LlamaMLP(ctx, layer_idx, f"{prefix}.shared_expert",
                                      intermediate_size=cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each token goes to its top-k experts by router logit, each copy multiplied by
        sigmoid(that logit) *before* the expert; the experts' outputs are summed unweighted.
        (transformers runs every expert on every token with a zero input for the unchosen
        ones, whose output is then exactly zero: the experts have no bias.)"""
        t, h = x.shape
        logits = self.router(x)
        top_logits, top_ids = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)  # [T, k]
        # one row per (token, expert) pair, so that each copy carries its own scale
        routed_in = (x[:, None, :] * scores[..., None]).reshape(t * self.top_k, h)
        ones = torch.ones(t * self.top_k, 1, dtype=torch.float32, device=x.device)
        # run_experts takes the model's expert ids (under expert parallelism it gives other
        # ranks' pairs weight 0); the ranks' partial sums are reduced once, below
        routed = self.experts.run_experts(routed_in, ones, top_ids.reshape(-1, 1))
        routed = self.experts.reduce_group.all_reduce(routed.view(t, self.top_k, h).sum(dim=1))
        return self.shared_expert(x) + routed


# ---------------------------------------------------------------- layers and model

class Llama4DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with its feed-forward named `feed_forward` as in the checkpoint, so
    quantizers' prefixes match it."""

    mlp_name = "feed_forward"


class Llama4PositionTables(nn.Module):
    """What every layer needs per token position, looked up once per step: the rotary
    cos/sin rows and the NoPE layers' query temperature (None when tuning is off)."""

    def __init__(self, rotary: nn.Module, cfg: Any) -> None:
        super().__init__()
        self.rotary = rotary
        self.tuning = bool(getattr(cfg, "attn_temperature_tuning", True))
        self.floor_scale = float(getattr(cfg, "floor_scale", 8192))
        self.attn_scale = float(getattr(cfg, "attn_scale", 0.1))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        cos, sin = self.rotary.lookup(positions)
        if not self.tuning:
            return cos, sin, None
        steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return cos, sin, torch.log1p(steps) * self.attn_scale + 1.0


class Llama4Model(LlamaModel):
    """Llama's model with Llama 4's per-position tables (rotary rows and q temperature)."""

    def make_position_tables(self, ctx: ModelContext) -> nn.Module:
        return Llama4PositionTables(super().make_position_tables(ctx), ctx.hf_config)


class Llama4ForCausalLM(LlamaForCausalLM):
    # attention and MLPs split as Llama's, experts by FusedMoE (tensor or expert parallel);
    # pipeline stages as Llama's (tests/plugins/models/test_llama4_parallel.py)
    supports_parallel = True
    attention_cls = Llama4Attention
    decoder_layer_cls = Llama4DecoderLayer
    model_cls = Llama4Model

    def mlp_cls(self, layer_idx: int) -> type[nn.Module]:
        return Llama4MoE if layer_idx in moe_layers(self.context.hf_config) else Llama4DenseMLP

    @classmethod
    def kv_cache_spec(cls, hf_config: Any) -> KVCacheSpec:
        return llama4_kv_cache_spec(hf_config)

    def _target(self, name: str):
        return FusedMoE.checkpoint_target(name) or super()._target(name)

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(self._expert_layout(weights))
        process_moe_after_loading(self)
        return loaded

    @staticmethod
    def _expert_layout(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """transformers' stacked experts [E, in, out] -> FusedMoE's [E, out, in]."""
        for name, tensor in weights:
            if _STACKED_EXPERTS.search(name):
                if tensor.dim() != 3:
                    raise ValueError(f"checkpoint tensor {name!r}: expected stacked experts [E, in, out], "
                                     f"got shape {tuple(tensor.shape)}")
                tensor = tensor.transpose(1, 2)
            yield name, tensor
