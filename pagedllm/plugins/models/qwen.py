"""Qwen2 and Qwen3: Llama's shape with a biased qkv projection (Qwen2) or per-head
q/k RMSNorm and no bias (Qwen3)."""

from __future__ import annotations

from pagedllm.core.contracts import ModelContext
from pagedllm.plugins.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention

    def __init__(self, context: ModelContext) -> None:
        if getattr(context.hf_config, "use_sliding_window", False):
            raise NotImplementedError("Qwen2 with use_sliding_window=true is not supported yet")
        super().__init__(context)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

    def __init__(self, context: ModelContext) -> None:
        if getattr(context.hf_config, "use_sliding_window", False):
            raise NotImplementedError("Qwen3 with use_sliding_window=true is not supported yet")
        super().__init__(context)
