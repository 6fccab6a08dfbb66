"""Gemma 3 (text) and Gemma 2: Llama's skeleton with Gemma's choices.

What differs from Llama, as transformers implements it:
- every RMSNorm scales by (1 + w), and each decoder layer norms the attention and MLP
  outputs too (post_attention_layernorm, pre_/post_feedforward_layernorm);
- token embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first;
- the MLP is a GeGLU (gelu, tanh approximation);
- queries are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- layers are "sliding_attention" (a window of `sliding_window` tokens) or
  "full_attention" (`layer_types`), and Gemma 3 gives the two kinds their own RoPE
  (`rope_parameters` per layer type; older configs: rope_local_base_freq / rope_theta);
- Gemma 3 normalises q and k per head; Gemma 2 soft-caps attention logits instead;
- final logits may be soft-capped (final_logit_softcapping).

Parallelism is Llama's (the forward is LlamaModel's through its hooks): q/k/v and
gate/up split by columns, o and down by rows, the vocabulary by rows. The embedding scale
multiplies the all-reduced rows, and the final soft-cap runs on the gathered logits (the
vocab-parallel head's `logits` returns the whole row), so both see what one rank sees; the
per-head q/k norms and attention soft-caps act on the rank's own heads.

transformers' Gemma 3 never applies attn_logit_softcapping (its attention does not pass it
on), so neither do we; Gemma 2 does.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedllm import ops
from pagedllm.core.contracts import AttentionContext, KVCacheSpec, ModelContext
from pagedllm.plugins.models.layers import (
    attention_projections,
    Attention,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    rope_parameters,
)
from pagedllm.plugins.models.llama import LlamaForCausalLM, LlamaModel, llama_kv_cache_spec, table_length

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' defaults when a config names no theta for a layer type (Gemma 3)
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
# ACT2FN names of gelu with the tanh approximation, the only activation Gemma checkpoints use
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


def layer_types(cfg: Any) -> list[str]:
    """Each layer's attention kind: the config's `layer_types`, else derived from
    `sliding_window_pattern` (every pattern-th layer global) as transformers does."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        pattern = getattr(cfg, "sliding_window_pattern", None) or getattr(cfg, "_sliding_window_pattern", None)
        if not pattern:
            raise ValueError("a Gemma config needs layer_types or sliding_window_pattern")
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_hidden_layers)]
    types = list(types)
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown or len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types must name {cfg.num_hidden_layers} layers, each {SLIDING!r} or {FULL!r}; "
                         f"got {types}")
    return types


def gemma_sliding_windows(cfg: Any) -> tuple[int | None, ...]:
    """`sliding_window` on the "sliding_attention" layers, None on the global ones."""
    window = getattr(cfg, "sliding_window", None)
    return tuple(int(window) if t == SLIDING else None for t in layer_types(cfg)) if window else ()


def gemma_kv_cache_spec(cfg: Any) -> KVCacheSpec:
    """Llama's head facts plus each layer's window."""
    return llama_kv_cache_spec(cfg, gemma_sliding_windows)


def rope_by_layer_type(cfg: Any) -> dict[str, tuple[float, dict[str, Any]]]:
    """(theta, scaling) per layer type.

    transformers >= 5 keeps Gemma 3's as `rope_parameters = {layer type: {rope_theta,
    rope_type, ...}}`; older configs (and GGUF-built ones) say rope_theta + rope_scaling for
    the global layers and rope_local_base_freq (no scaling) for the sliding ones. Gemma 2 has
    one flat set for both."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if SLIDING in params or FULL in params:
        out = {}
        for kind in (SLIDING, FULL):
            scaling = dict(params.get(kind) or {})
            theta = scaling.pop("rope_theta", None) or _DEFAULT_THETA[kind]
            out[kind] = (float(theta), scaling)
        return out
    global_rope = rope_parameters(cfg)
    local_theta = getattr(cfg, "rope_local_base_freq", None)
    return {FULL: global_rope, SLIDING: (float(local_theta), {}) if local_theta else global_rope}


class GemmaAttention(nn.Module):
    """qkv -> (per-head q/k norm) -> rotary -> windowed or global attention -> o_proj."""

    qk_norm = True  # Gemma 3: per-head (1 + w) RMSNorm of q and k before rotary
    attn_soft_cap = False  # Gemma 2: tanh soft-capping of the attention logits

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        spec = gemma_kv_cache_spec(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        # the projections split the model's heads; this layer computes with the rank's
        self.qkv_proj, self.o_proj = attention_projections(ctx, spec.num_heads, spec.num_kv_heads, spec.head_size,
                                                           prefix, bias, bias)
        spec = spec.for_tensor_parallel(ctx.parallel.tp.size)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=1.0, dtype=ctx.dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=1.0, dtype=ctx.dtype)
        soft_cap = getattr(cfg, "attn_logit_softcapping", None) if self.attn_soft_cap else None
        self.attn = Attention(ctx, layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=float(cfg.query_pre_attn_scalar) ** -0.5, sliding_window=spec.window(layer_idx),
                              logits_soft_cap=soft_cap)
        self.sizes = (q_size, kv_size, kv_size)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qk_norm:
            q, k, v = qkv.split(self.sizes, dim=-1)
            t = qkv.shape[0]
            q = self.q_norm(q.reshape(t * self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t * self.num_kv_heads, self.head_dim)).view(t, -1)
            qkv = torch.cat((q, k, v), dim=-1)
        q, k, v = ops.rotary_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *rope)
        return self.o_proj(self.attn(q, k, v, attn))


class Gemma2Attention(GemmaAttention):
    qk_norm = False
    attn_soft_cap = True


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused (by columns over tensor-parallel
    ranks, down by rows: one all-reduce, as Llama's MLP)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh"
        if act not in _GELU_TANH:
            raise NotImplementedError(f"hidden_activation {act!r} is not supported by Gemma "
                                      f"(supported: {', '.join(_GELU_TANH)})")
        tp = ctx.parallel.tp
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size] * 2, quant_config=ctx.quant_config,
                                   prefix=f"{prefix}.gate_up_proj", params_dtype=ctx.dtype, parallel="column", tp=tp)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, quant_config=ctx.quant_config,
                                prefix=f"{prefix}.down_proj", params_dtype=ctx.dtype, parallel="row", tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gelu_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms: stream += post_norm(block(pre_norm(stream))) for attention then MLP.

    As in Llama the stream travels as (x, residual) with stream = x + residual, so each
    pre-norm also does the sum (ops.rms_norm with a residual)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str, attention_cls: type[nn.Module],
                 mlp_cls: type[nn.Module]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.layer_type = layer_types(cfg)[layer_idx]
        self.self_attn = attention_cls(ctx, layer_idx, f"{prefix}.self_attn")
        self.mlp = mlp_cls(ctx, layer_idx, f"{prefix}.mlp")

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0, dtype=ctx.dtype)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, rope, x, residual, attn):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x, attn))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaRotaries(nn.Module):
    """One rotary table per distinct rope of the layer types (sliding layers: the local base),
    looked up once per step; `of[layer type]` names the table a layer reads."""

    def __init__(self, cfg: Any, max_model_len: int | None = None) -> None:
        super().__init__()
        head_size = gemma_kv_cache_spec(cfg).head_size
        ropes = rope_by_layer_type(cfg)
        self.tables = nn.ModuleDict()
        self.of: dict[str, str] = {}  # layer type -> the table it uses (shared when equal)
        for kind in sorted(set(layer_types(cfg))):
            same = next((k for k in self.tables if ropes[k] == ropes[kind]), None)
            if same is None:
                theta, scaling = ropes[kind]
                self.tables[kind] = RotaryEmbedding(head_size, table_length(cfg, max_model_len), theta, scaling,
                                                    max_position_embeddings=cfg.max_position_embeddings)
            self.of[kind] = same or kind

    def lookup(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: rotary.lookup(positions) for name, rotary in self.tables.items()}


class GemmaModel(LlamaModel):
    """Llama's stack with (1 + w) norms, embeddings scaled by sqrt(hidden) and a rotary table
    per layer type."""

    norm_offset = 1.0

    def __init__(self, ctx: ModelContext, make_layer: Callable[[int, str], nn.Module]) -> None:
        super().__init__(ctx, make_layer)
        # transformers rounds sqrt(hidden) to the model dtype before multiplying (bf16: 55.4 -> 55.5)
        self.embed_scale = float(torch.tensor(ctx.hf_config.hidden_size ** 0.5, dtype=ctx.dtype))

    def make_position_tables(self, ctx: ModelContext) -> nn.Module:
        return GemmaRotaries(ctx.hf_config, ctx.max_model_len)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def layer_tables(self, tables: Any, layer: nn.Module) -> Any:
        return tables[self.rotary.of[layer.layer_type]]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text checkpoints (config Gemma3TextConfig, model_type gemma3_text)."""
    # splits as Llama does (tests/plugins/models/test_gemma_parallel.py)
    supports_parallel = True

    attention_cls = GemmaAttention
    decoder_layer_cls = GemmaDecoderLayer
    model_cls = GemmaModel

    def __init__(self, context: ModelContext) -> None:
        cfg = context.hf_config
        if getattr(cfg, "use_bidirectional_attention", False):
            raise NotImplementedError(f"{type(self).__name__} with use_bidirectional_attention=true "
                                      "(EmbeddingGemma) is not supported: this engine decodes causally")
        super().__init__(context)
        self.final_soft_cap = getattr(cfg, "final_logit_softcapping", None)

    def mlp_cls(self, layer_idx: int) -> type[nn.Module]:
        return GemmaMLP

    def compute_logits(self, hidden_states):
        # the head gathers every rank's vocabulary columns first: the cap sees whole rows
        logits = super().compute_logits(hidden_states)
        if self.final_soft_cap:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits

    @classmethod
    def kv_cache_spec(cls, hf_config: Any) -> KVCacheSpec:
        return gemma_kv_cache_spec(hf_config)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: no q/k norm, attention logits soft-capped, one RoPE for every layer."""

    attention_cls = Gemma2Attention
