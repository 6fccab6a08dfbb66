"""Qwen2 and Qwen3: Llama's shape with a biased qkv projection (Qwen2) or per-head
q/k RMSNorm and no bias (Qwen3); with `use_sliding_window`, the layers `layer_types`
marks (by default those from `max_window_layers` on) attend to the last `sliding_window`
tokens."""

from __future__ import annotations

from pagedllm.plugins.models.llama import LlamaAttention, LlamaForCausalLM, layer_type_windows


class Qwen2Attention(LlamaAttention):
    qkv_bias = True
    out_bias_follows_attention_bias = False  # transformers' Qwen2 o_proj has no bias
    sliding_windows = staticmethod(layer_type_windows)


class Qwen3Attention(LlamaAttention):
    qk_norm = True
    sliding_windows = staticmethod(layer_type_windows)


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
