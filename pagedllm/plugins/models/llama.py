"""Llama and the architectures that share its shape (Llama 2/3/3.1, SmolLM2, Mistral).

Reads top-down: config facts -> attention -> MLP -> decoder layer -> model ->
checkpoint mapping. A decoder layer is built from the architecture's attention and MLP
classes (`LlamaForCausalLM.attention_cls`, `mlp_cls(layer_idx)`), so a new architecture
that differs in one of them is a short subclass: Qwen2 and Qwen3 swap the attention for
one with a qkv bias or per-head q/k RMSNorm, the MoE models pick a sparse MLP per layer.

Parallelism (`ModelContext.parallel`): the attention and MLP split over the
tensor-parallel group (q/k/v and gate/up by columns, o and down by rows, the vocabulary by
rows); a pipeline stage builds only its own decoder layers (`stage_layers`), the first
stage the embedding, the last the final norm and the head, and stages hand each other the
hidden state and residual (`IntermediateTensors`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import nn

from pagedllm import ops
from pagedllm.core.contracts import AttentionContext, CausalLM, IntermediateTensors, KVCacheSpec, ModelContext
from pagedllm.core.loader import derived_max_model_len
from pagedllm.plugins.models.layers import (
    attention_projections,
    Attention,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    load_shard,
    rope_parameters,
)


SlidingWindows = Callable[[Any], tuple[int | None, ...]]  # hf_config -> per-layer windows (() = all global)


def no_sliding_windows(cfg: Any) -> tuple[int | None, ...]:
    """Llama: every layer global (transformers' Llama ignores a stray `sliding_window`)."""
    return ()


def every_layer_window(cfg: Any) -> tuple[int | None, ...]:
    """Mistral: `sliding_window` on every layer when set (transformers' Mistral applies the
    config's window to all layers and ignores `layer_types`)."""
    window = getattr(cfg, "sliding_window", None)
    return (int(window),) * cfg.num_hidden_layers if window else ()


def layer_type_windows(cfg: Any) -> tuple[int | None, ...]:
    """Qwen2 / Qwen3: the layers `layer_types` marks "sliding_attention" take `sliding_window`.
    transformers' config derives both: `sliding_window` is None unless `use_sliding_window`,
    and without explicit `layer_types` the layers from `max_window_layers` on slide."""
    window = getattr(cfg, "sliding_window", None)
    if not getattr(cfg, "use_sliding_window", True):
        window = None  # already so in transformers' config classes; not in a hand-built config
    types = getattr(cfg, "layer_types", None)
    if types is None:
        first = getattr(cfg, "max_window_layers", 0)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(cfg.num_hidden_layers)]
    if "sliding_attention" not in types:
        return ()
    if window is None:
        raise ValueError("layer_types marks sliding_attention layers but the config sets no sliding_window "
                         "(use_sliding_window is false); transformers refuses it too")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def llama_kv_cache_spec(cfg: Any, sliding_windows: SlidingWindows = no_sliding_windows) -> KVCacheSpec:
    """Head counts and head size as Hugging Face's Llama config spells them; per-layer
    windows by the architecture's rule (`LlamaAttention.sliding_windows`)."""
    num_heads = cfg.num_attention_heads
    return KVCacheSpec(num_layers=cfg.num_hidden_layers, num_heads=num_heads,
                       num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
                       head_size=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
                       sliding_windows=sliding_windows(cfg))


class LlamaAttention(nn.Module):
    qkv_bias = False  # Qwen2: True (a config's attention_bias also turns it on)
    # whether a config's attention_bias also gives o_proj a bias, as in transformers' Llama
    # and Qwen3 (its Qwen2 never has one); an explicit attention_out_bias decides first
    out_bias_follows_attention_bias = True
    qk_norm = False  # Qwen3: per-head RMSNorm of q and k before rotary
    # which layers slide, from the config (the model class's kv_cache_spec reads the same rule)
    sliding_windows: SlidingWindows = staticmethod(no_sliding_windows)

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = self.qkv_bias or attention_bias
        out_bias = bool(getattr(cfg, "attention_out_bias", attention_bias and self.out_bias_follows_attention_bias))
        qk_norm = self.qk_norm
        spec = llama_kv_cache_spec(cfg, self.sliding_windows)
        # the projections split the model's heads; this layer computes with the rank's
        self.qkv_proj, self.o_proj = attention_projections(
            ctx, spec.num_heads, spec.num_kv_heads, spec.head_size, prefix, qkv_bias, out_bias)
        spec = spec.for_tensor_parallel(ctx.parallel.tp.size)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=ctx.dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=ctx.dtype)
        self.qk_norm = qk_norm
        self.attn = Attention(ctx, layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5, sliding_window=spec.window(layer_idx))
        self.sizes = (q_size, kv_size, kv_size)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qk_norm:
            qkv = self._norm_qk(qkv)
        q, k, v = ops.rotary_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *rope)
        return self.o_proj(self.attn(q, k, v, attn))

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head RMSNorm of q and k, before rotary (v passes unchanged)."""
        q, k, v = qkv.split(self.sizes, dim=-1)
        t, d = qkv.shape[0], self.head_dim
        q = self.q_norm(q.reshape(t * self.num_heads, d)).view(t, -1)
        k = self.k_norm(k.reshape(t * self.num_kv_heads, d)).view(t, -1)
        return torch.cat((q, k, v), dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str, intermediate_size: int | None = None) -> None:
        """`intermediate_size` defaults to the config's (MoE models' shared experts have their own)."""
        super().__init__()
        cfg = ctx.hf_config
        inter = intermediate_size or cfg.intermediate_size
        tp = ctx.parallel.tp  # gate/up by columns, down by rows: one all-reduce per MLP
        self.gate_up_proj = Linear(cfg.hidden_size, [inter] * 2, quant_config=ctx.quant_config,
                                   prefix=f"{prefix}.gate_up_proj", params_dtype=ctx.dtype, parallel="column", tp=tp)
        self.down_proj = Linear(inter, cfg.hidden_size, quant_config=ctx.quant_config,
                                prefix=f"{prefix}.down_proj", params_dtype=ctx.dtype, parallel="row", tp=tp)
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} is not supported by the Llama family (silu only)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP, each with a residual (the sums fused into the norms)."""

    # the MLP's attribute (and checkpoint) name: Llama 4 calls it "feed_forward"
    mlp_name = "mlp"

    def __init__(self, ctx: ModelContext, layer_idx: int, prefix: str, attention_cls: type[nn.Module],
                 mlp_cls: type[nn.Module]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.self_attn = attention_cls(ctx, layer_idx, f"{prefix}.self_attn")
        setattr(self, self.mlp_name, mlp_cls(ctx, layer_idx, f"{prefix}.{self.mlp_name}"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=ctx.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=ctx.dtype)

    def forward(self, rope, x, residual, attn):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.mlp_name)(x), residual


def table_length(cfg: Any, max_model_len: int | None = None) -> int:
    """Positions a per-position table must cover: the longest context the config allows
    (scaled rope: past max_position_embeddings), or the engine's when it is longer."""
    return max(derived_max_model_len(cfg)[0], max_model_len or 0)


def rotary_for(cfg: Any, rotary_dim: int, max_model_len: int | None = None) -> RotaryEmbedding:
    """The rotary tables of a config's rope (theta, scaling) over `rotary_dim` dims, long enough
    for the longest context the engine allows (`table_length`)."""
    theta, scaling = rope_parameters(cfg)
    return RotaryEmbedding(rotary_dim, table_length(cfg, max_model_len), theta, scaling,
                           max_position_embeddings=cfg.max_position_embeddings)


class AbsentLayer(nn.Module):
    """Stands where a module another pipeline stage holds would be: no parameters, so
    indices (`model.layers.7`) stay global and nothing is loaded into it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name} belongs to another pipeline stage; this stage does not hold it")


class LlamaModel(nn.Module):
    """Embedding -> decoder layers -> final norm. Subclasses change what differs through
    `norm_offset`, `make_position_tables` (what layers read per position, looked up once
    per step), `embed` and `layer_tables` (which of those tables a layer gets).

    A pipeline stage holds the layers `ctx.parallel.stage_layers(n)` (`self.stage`); the
    others are `AbsentLayer`s. Only the first stage embeds, only the last norms."""

    norm_offset = 0.0  # Gemma: (1 + w) norms

    def __init__(self, ctx: ModelContext, make_layer: Callable[[int, str], nn.Module]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        parallel = ctx.parallel
        self.first_stage, self.last_stage = parallel.pp.first, parallel.pp.last
        self.stage = parallel.stage_layers(cfg.num_hidden_layers)
        # untied: the model's own lm_head computes the logits, so no head is built for this one
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype, ctx.quant_config,
                                            "model.embed_tokens", tp=parallel.tp, serves_logits=tied)
                             if self.first_stage else AbsentLayer("model.embed_tokens"))
        self.layers = nn.ModuleList(make_layer(i, f"model.layers.{i}") if i in self.stage
                                    else AbsentLayer(f"model.layers.{i}") for i in range(cfg.num_hidden_layers))
        self.norm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=self.norm_offset, dtype=ctx.dtype)
                     if self.last_stage else AbsentLayer("model.norm"))
        self.rotary = self.make_position_tables(ctx)
        self.aux_layers: tuple[int, ...] = ()

    def absent_prefixes(self) -> tuple[str, ...]:
        """Checkpoint name prefixes of what other pipeline stages hold (`model.layers.7.`)."""
        return tuple(f"model.{name}." for name, module in self.named_children() if isinstance(module, AbsentLayer)) + \
            tuple(f"model.layers.{i}." for i, layer in enumerate(self.layers) if isinstance(layer, AbsentLayer))

    def make_position_tables(self, ctx: ModelContext) -> nn.Module:
        """A module whose `lookup(positions)` gives what the layers read per position."""
        return rotary_for(ctx.hf_config, llama_kv_cache_spec(ctx.hf_config).head_size, ctx.max_model_len)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def layer_tables(self, tables: Any, layer: nn.Module) -> Any:
        """The part of the step's position tables `layer` reads (all of them here)."""
        return tables

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if self.first_stage:
            x, residual = self.embed(input_ids), None
        else:
            if intermediate is None:
                raise ValueError("a pipeline stage other than the first needs the previous stage's "
                                 "IntermediateTensors (hidden_states, residual)")
            x, residual = intermediate["hidden_states"], intermediate["residual"]
        tables = self.rotary.lookup(positions)
        aux = {}
        for i in self.stage:
            layer = self.layers[i]
            if i in self.aux_layers:
                aux[i] = x if residual is None else x + residual
            x, residual = layer(self.layer_tables(tables, layer), x, residual, attn)
        if not self.last_stage:
            return IntermediateTensors({"hidden_states": x, "residual": residual})
        x, _ = self.norm(x, residual)
        return torch.cat([x, *(aux[i] for i in self.aux_layers)], dim=-1) if aux else x


class LlamaForCausalLM(CausalLM):
    # checkpoint sub-module name -> (our fused module, shard index)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    attention_cls: type[nn.Module] = LlamaAttention
    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer
    model_cls: type[nn.Module] = LlamaModel
    # splits over tensor-parallel ranks and pipeline stages (Mistral, Qwen2, Qwen3 inherit it)
    supports_parallel = True

    def __init__(self, context: ModelContext) -> None:
        super().__init__(context)
        cfg = context.hf_config
        pp = context.parallel.pp
        self.model = self.model_cls(context, self.make_layer)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # the head: tied embeddings share the embedding where one stage holds both; a last
        # stage that is not the first builds its own copy, loaded from the embedding's tensor
        self.head_is_embedding = self.tie_word_embeddings and pp.first
        if pp.last and not self.head_is_embedding:
            self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, context.dtype, context.quant_config,
                                          "lm_head", tp=context.parallel.tp)

    def mlp_cls(self, layer_idx: int) -> type[nn.Module]:
        """The MLP class of decoder layer `layer_idx` (MoE models: sparse or dense per layer)."""
        return LlamaMLP

    def make_layer(self, layer_idx: int, prefix: str) -> nn.Module:
        return self.decoder_layer_cls(self.context, layer_idx, prefix, self.attention_cls, self.mlp_cls(layer_idx))

    def forward(self, input_ids, positions, attn, intermediate=None):
        return self.model(input_ids, positions, attn, intermediate)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        parallel = self.context.parallel
        if layers and (parallel.pp.size > 1 or parallel.tp.size > 1):
            raise NotImplementedError(
                f"{type(self).__name__}: inner layers' hidden states (EAGLE-3) with "
                f"pipeline_parallel_size={parallel.pp.size}, tensor_parallel_size={parallel.tp.size} are not "
                "supported yet (the stages would have to gather them); use one rank or another speculative method")
        bad = [i for i in layers if not 0 <= i < len(self.model.layers)]
        if bad:
            raise ValueError(f"hidden-state layers {bad} are outside this model's {len(self.model.layers)} layers")
        self.model.aux_layers = tuple(layers)

    def compute_logits(self, hidden_states):
        if not self.context.parallel.pp.last:
            raise RuntimeError("only the last pipeline stage computes logits")
        head = self.model.embed_tokens if self.head_is_embedding else self.lm_head
        return head.logits(hidden_states).float()

    @classmethod
    def kv_cache_spec(cls, hf_config: Any) -> KVCacheSpec:
        return llama_kv_cache_spec(hf_config, getattr(cls.attention_cls, "sliding_windows", no_sliding_windows))

    def _target(self, name: str) -> tuple[str, int | None]:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules_mapping:
                fused, shard = self.packed_modules_mapping[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
        return name, None

    def _set_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        layer_idx = int(name.split("model.layers.")[1].split(".")[0])
        impl = self.model.layers[layer_idx].self_attn.attn.impl
        setattr(impl, name.rsplit(".", 1)[1], float(tensor.float().max()))

    def _other_stages(self) -> tuple[str, ...]:
        """Checkpoint name prefixes this pipeline stage does not load (other stages' layers,
        the embedding off the first stage, the final norm and head off the last)."""
        absent = self.model.absent_prefixes()
        if not self.context.parallel.pp.last:
            absent += ("lm_head.",)
        return absent

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        """Every checkpoint tensor into its parameter (fused shards by `packed_modules_mapping`,
        this rank's part under tensor parallelism); tensors of modules another pipeline stage
        holds are skipped, and only this stage's parameters must all be filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        absent = self._other_stages()
        tied_copy = self.tie_word_embeddings and not self.head_is_embedding and hasattr(self, "lm_head")
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if tied_copy and name == "model.embed_tokens.weight":
                name = "lm_head.weight"  # a last stage's own copy of the tied matrix
            if name.startswith(absent):
                continue
            if name.endswith((".k_scale", ".v_scale")):  # FP8 KV-cache scales
                self._set_kv_scale(name, tensor)
                continue
            target, shard = self._target(name)
            if target.startswith(absent):
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            try:
                load_shard(params[target], tensor, shard)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name!r}: {exc}") from None
            loaded.add(target)
        missing = {n for n in set(params) - loaded if not getattr(params[n], "optional", False)}
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {sorted(missing)[:8]}"
                             f"{' …' if len(missing) > 8 else ''}")
        return loaded


class MistralAttention(LlamaAttention):
    sliding_windows = staticmethod(every_layer_window)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with `sliding_window` on every layer when the config sets one (then blocks older
    than the window are released as a request runs)."""

    attention_cls = MistralAttention
