"""DeepSeek-V2 (V2-Lite) and DeepSeek-V3 (R1): multi-head latent attention and MoE with
shared experts, on Llama's decoder skeleton (pre-norm attention then MLP, each residual).

Attention (MLA). A token's keys and values for every head come from one compressed
latent: c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:L]) (L = kv_lora_rank), plus one
rotary key part k_pe (R = qk_rope_head_dim) shared by all heads. transformers expands c
into per-head keys and values with kv_b_proj = [W_UK_h; W_UV_h] per head h:
  k_h = [W_UK_h c, k_pe],  v_h = W_UV_h c,  q_h = [q_nope_h, q_pe_h],
  out_h = softmax(q_h . k_h * scale) @ v_h.
Since q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c and sum_t p_t W_UV_h c_t =
W_UV_h (sum_t p_t c_t), the same numbers come out of the "absorbed" form this module
runs (what vLLM and FlashMLA do):
  query_h = [W_UK_h^T q_nope_h, q_pe_h]   ([H, L + R] per token)
  latent  = [c, k_pe]                     ([1, L + R] per token: all the KV cache holds)
  o_h     = softmax(query_h . latent * scale) @ latent[:L]   (the backend's "mla" kind)
  out_h   = W_UV_h o_h, then o_proj.
In exact arithmetic both are equal; in float32 they agree to rounding. The cache holds
L + R elements per token and layer instead of 2 x H x head sizes.

The softmax scale is (qk_nope_head_dim + qk_rope_head_dim)^-0.5, times YaRN's
mscale(factor, mscale_all_dim)^2 when the rope is YaRN-scaled (transformers'
`yarn_apply_mscale`); the cos/sin tables carry YaRN's own attention factor (rope.py).

RoPE on the R rotary dims: DeepSeek pairs neighbouring dims (x0, x1), (x2, x3), ...
(V2 as complex numbers, V3 with `rope_interleave`, its default); V3 without it pairs
halves as Llama does. Rotated q_pe and k_pe only meet in their dot product, so the
order the rotated pairs are written in does not matter as long as both use the same.

MoE. Layers from `first_k_dense_replace` on (every `moe_layer_freq`-th, always 1 in
published configs) route each token to `num_experts_per_tok` of `n_routed_experts`
experts (`FusedMoE`, moe.py) and add `n_shared_experts` shared experts (one dense MLP of
moe_intermediate_size x n_shared_experts). V3 routes with sigmoid scores, a selection
bias (`e_score_correction_bias`) and groups (`n_group` groups ranked by their two best
scores, `topk_group` kept), renormalized when `norm_topk_prob`; V2 with softmax scores,
"greedy" (plain top-k) or "group_limited_greedy" (groups ranked by their best score).
Both multiply the weights by `routed_scaling_factor`. The router (`mlp.gate`) runs in
float32, as transformers keeps it.

Parallelism. Tensor parallelism splits MLA by heads: q_a_proj and kv_a_proj_with_mqa (small
down-projections into the latents every head reads) are whole on every rank, q_b_proj (or
V2-Lite's q_proj) and kv_b_proj are column-parallel by heads (each head's rows are
contiguous), o_proj row-parallel. The latent KV cache is not split: each rank caches the
whole latent for its H / tp heads (`KVCacheSpec.for_tensor_parallel` keeps MLA's one
latent per token; vLLM does the same), and `absorb` reads the rank's heads of kv_b_proj.
The routed experts split as FusedMoE splits them (tensor or expert parallel; the V2
group-limited router hands its choice to `run_experts`), the shared experts are a
column/row MLP, the router is replicated. Pipeline stages are Llama's.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch
from torch import nn

from pagedllm.core.contracts import AttentionContext, KVCacheSpec, ModelContext
from pagedllm.plugins.models.layers import Linear, RMSNorm
from pagedllm.plugins.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, rotary_for
from pagedllm.plugins.models.moe import FusedMoE, process_moe_after_loading
from pagedllm.plugins.models.rope import rope_parameters, yarn_attention_scale

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not
# the config's rms_norm_eps (equal in published checkpoints)
LATENT_NORM_EPS = 1e-6
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mla_kv_cache_spec(cfg: Any) -> KVCacheSpec:
    """One latent of kv_lora_rank + qk_rope_head_dim per token and layer; values are its
    first kv_lora_rank elements."""
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return KVCacheSpec(num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads, num_kv_heads=1,
                       head_size=latent, latent_size=latent, value_size=cfg.kv_lora_rank)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x [T, ..., R] by cos/sin [T, R/2] (float32 math, x's dtype out).

    Pair i is (x[2i], x[2i+1]) when `interleaved` (DeepSeek's layout), else (x[i],
    x[i + R/2]) (Llama's). The rotated pairs come out as [firsts | seconds] either way."""
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class LatentAttention(nn.Module):
    """The backend call of one MLA layer: queries [T, H, L + R] and the new tokens'
    latents [T, 1, L + R] in, per-head latent outputs [T, H, L] out."""

    def __init__(self, ctx: ModelContext, layer_idx: int, num_heads: int, latent_size: int, value_size: int,
                 scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        spec = ctx.attention_spec(num_heads, 1, latent_size, kind="mla", value_size=value_size)
        self.impl = ctx.attention_backend.impl_cls()(spec, scale)

    def forward(self, query: torch.Tensor, latent: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        return self.impl.forward(query, latent, None, attn.kv_caches[self.layer_idx], attn.metadata)


class DeepseekV3Attention(nn.Module):
    """MLA in the absorbed form (see the module docstring)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        quant, dtype = ctx.quant_config, ctx.dtype
        tp = ctx.parallel.tp
        if cfg.num_attention_heads % tp.size:
            raise ValueError(f"tensor_parallel_size={tp.size} does not divide the model's "
                             f"{cfg.num_attention_heads} attention heads; pick a size that does")
        self.num_heads = cfg.num_attention_heads // tp.size  # this rank's heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.lora = cfg.kv_lora_rank
        self.interleaved = self.rope_interleaved(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        # the model's head count: column/row layers take whole-layer sizes and keep the rank's part
        hidden, heads, qk_dim = cfg.hidden_size, cfg.num_attention_heads, self.nope + self.rope
        split = dict(parallel="column", tp=tp)
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias, quant_config=quant,
                                   prefix=f"{prefix}.q_a_proj", params_dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(self.q_lora_rank, heads * qk_dim, quant_config=quant,
                                   prefix=f"{prefix}.q_b_proj", params_dtype=dtype, **split)
        else:  # V2-Lite: no query compression
            self.q_proj = Linear(hidden, heads * qk_dim, quant_config=quant, prefix=f"{prefix}.q_proj",
                                 params_dtype=dtype, **split)
        self.kv_a_proj_with_mqa = Linear(hidden, self.lora + self.rope, bias=bias, quant_config=quant,
                                         prefix=f"{prefix}.kv_a_proj_with_mqa", params_dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.lora, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = Linear(self.lora, heads * (self.nope + self.v_dim), quant_config=quant,
                                prefix=f"{prefix}.kv_b_proj", params_dtype=dtype, **split)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias=bias, quant_config=quant, prefix=f"{prefix}.o_proj",
                             params_dtype=dtype, parallel="row", tp=tp)
        _, scaling = rope_parameters(cfg)
        scale = qk_dim ** -0.5 * yarn_attention_scale(scaling)
        self.attn = LatentAttention(ctx, layer_idx, self.num_heads, self.lora + self.rope, self.lora, scale)
        self._w_uk: torch.Tensor | None = None  # [H, nope, L]
        self._w_uv: torch.Tensor | None = None  # [H, L, v_dim]

    @staticmethod
    def rope_interleaved(cfg: Any) -> bool:
        """V3: `rope_interleave` (default true) pairs neighbouring rotary dims."""
        return bool(getattr(cfg, "rope_interleave", True))

    def absorb(self) -> None:
        """W_UK [H, nope, L] and W_UV^T [H, L, v_dim] from kv_b_proj (the model's after_loading).

        Read by applying kv_b_proj to the identity, so any quantized linear method works
        (its `apply` is all a method promises), once the method has repacked its weights.
        Under tensor parallelism kv_b_proj is column-parallel by heads: its output, and so
        H here, is this rank's heads."""
        ref = self.kv_a_layernorm.weight
        eye = torch.eye(self.lora, dtype=ref.dtype, device=ref.device)
        with torch.inference_mode():
            w = self.kv_b_proj(eye).T.reshape(self.num_heads, self.nope + self.v_dim, self.lora)
        self._w_uk = w[:, :self.nope].clone()
        self._w_uv = w[:, self.nope:].transpose(1, 2).contiguous()

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        cos, sin = rope
        t, heads = x.shape[0], self.num_heads
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(t, heads, self.nope + self.rope).split((self.nope, self.rope), dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split((self.lora, self.rope), dim=-1)
        c = self.kv_a_layernorm(c)
        q_pe = rotate_pairs(q_pe, cos, sin, self.interleaved)
        k_pe = rotate_pairs(k_pe, cos, sin, self.interleaved)
        w_uk, w_uv = self._w_uk, self._w_uv
        if w_uk is None or w_uv is None:
            raise RuntimeError("MLA attention ran before after_loading() absorbed kv_b_proj")
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        query = torch.cat((q_latent, q_pe), dim=-1)
        latent = torch.cat((c, k_pe), dim=-1).unsqueeze(1)  # [T, 1, L + R]
        o = self.attn(query, latent, attn)  # [T, H, L]
        out = torch.bmm(o.transpose(0, 1), w_uv).transpose(0, 1)  # [T, H, v_dim]
        return self.o_proj(out.reshape(t, heads * self.v_dim))


class DeepseekV2Attention(DeepseekV3Attention):
    @staticmethod
    def rope_interleaved(cfg: Any) -> bool:
        """V2 rotates neighbouring dims as complex numbers, always."""
        return True


def is_moe_layer(cfg: Any, layer_idx: int) -> bool:
    """Routed experts from `first_k_dense_replace` on, every `moe_layer_freq`-th layer."""
    freq = int(getattr(cfg, "moe_layer_freq", 1) or 1)
    return bool(getattr(cfg, "n_routed_experts", None)) and layer_idx >= (cfg.first_k_dense_replace or 0) \
        and layer_idx % freq == 0


class DeepseekV3MoE(nn.Module):
    """Router (float32), routed experts, shared experts."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        num_experts = cfg.n_routed_experts
        self.gate = Linear(cfg.hidden_size, num_experts, prefix=f"{prefix}.gate", params_dtype=torch.float32)
        self.experts = FusedMoE(ctx, num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, prefix, **self.routing(cfg))
        shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        self.shared_experts = LlamaMLP(ctx, layer_idx, f"{prefix}.shared_experts",
                                       intermediate_size=cfg.moe_intermediate_size * shared) if shared else None

    @staticmethod
    def routing(cfg: Any) -> dict[str, Any]:
        """FusedMoE's routing options: V3's grouped sigmoid routing with the selection bias."""
        groups = getattr(cfg, "n_group", None)
        return dict(renormalize=bool(getattr(cfg, "norm_topk_prob", True)), scoring="sigmoid",
                    num_expert_group=groups, topk_group=getattr(cfg, "topk_group", None) if groups else None,
                    has_correction_bias=True, routed_scaling_factor=float(cfg.routed_scaling_factor))

    def route(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return self.experts(x, logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.route(x, self.gate(x.float()))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV2MoE(DeepseekV3MoE):
    """V2: softmax scores; "greedy" top-k or "group_limited_greedy" (groups ranked by their
    best expert's score, which FusedMoE's grouped routing, ranking by the best two, does not
    do: routed here, then the experts run through FusedMoE's method)."""

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        cfg = ctx.hf_config
        method = getattr(cfg, "topk_method", "greedy") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise NotImplementedError(f"DeepSeek-V2 topk_method {method!r} is not supported "
                                      "(greedy, group_limited_greedy)")
        if getattr(cfg, "mlp_bias", False):
            raise NotImplementedError("DeepSeek-V2 with mlp_bias=true is not supported yet")
        super().__init__(ctx, layer_idx, prefix)
        self.topk_method = method
        self.num_groups, self.topk_group = getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None)

    @staticmethod
    def routing(cfg: Any) -> dict[str, Any]:
        # transformers' V2 router ignores norm_topk_prob (false in every published V2
        # config); DeepSeek's own code and vLLM renormalize when it is set, as here
        return dict(renormalize=bool(getattr(cfg, "norm_topk_prob", False)), scoring="softmax",
                    routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0)))

    def route(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.topk_method == "greedy":
            return self.experts(x, logits)
        scores = logits.float().softmax(dim=-1)
        t, e = scores.shape
        best = scores.view(t, self.num_groups, e // self.num_groups).amax(dim=-1)
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, best.topk(self.topk_group, dim=-1).indices, True)
        masked = scores.masked_fill(~keep.repeat_interleave(e // self.num_groups, dim=1), 0.0)
        weights, ids = masked.topk(self.experts.top_k, dim=-1)
        routing = self.experts.routing
        if routing["renormalize"]:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * routing["routed_scaling_factor"]
        # the model's expert ids: run_experts keeps this rank's (expert parallel) and reduces
        return self.experts.run_experts(x, weights, ids)


class DeepseekModel(LlamaModel):
    """Llama's stack with the rotary table over qk_rope_head_dim (the rotated part only)."""

    def make_position_tables(self, ctx: ModelContext) -> nn.Module:
        return rotary_for(ctx.hf_config, ctx.hf_config.qk_rope_head_dim, ctx.max_model_len)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    # MLA by heads, experts by FusedMoE, stages as Llama's (see the module docstring and
    # tests/plugins/models/test_deepseek_parallel.py)
    supports_parallel = True
    # the attention projections stay separate layers (their output sizes, e.g. 576, do not
    # split into the 128-row blocks of block-quantized FP8 checkpoints); MLPs fuse gate/up
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    attention_cls = DeepseekV3Attention
    moe_cls: type[nn.Module] = DeepseekV3MoE
    model_cls = DeepseekModel

    def __init__(self, context: ModelContext) -> None:
        act = getattr(context.hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"{type(self).__name__}: hidden_act {act!r} (silu only)")
        super().__init__(context)

    def mlp_cls(self, layer_idx: int) -> type[nn.Module]:
        return self.moe_cls if is_moe_layer(self.context.hf_config, layer_idx) else LlamaMLP

    @classmethod
    def kv_cache_spec(cls, hf_config: Any) -> KVCacheSpec:
        return mla_kv_cache_spec(hf_config)

    def _target(self, name: str):
        return FusedMoE.checkpoint_target(name) or super()._target(name)

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's loading plus the experts' names; the multi-token-prediction layers that
        V3 checkpoints append after the last decoder layer are skipped (not served)."""
        num_layers = self.context.hf_config.num_hidden_layers

        def decoder_weights():
            for name, tensor in weights:
                m = _LAYER.match(name)
                if m and int(m[1]) >= num_layers:
                    continue
                yield name, tensor

        loaded = super().load_weights(decoder_weights())
        process_moe_after_loading(self)
        return loaded

    def after_loading(self) -> None:
        for i in self.model.stage:  # this pipeline stage's layers (the others are AbsentLayers)
            self.model.layers[i].self_attn.absorb()


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    attention_cls = DeepseekV2Attention
    moe_cls = DeepseekV2MoE
