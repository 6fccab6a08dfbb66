"""Built-in model architectures, keyed by Hugging Face architecture name.

The model modules import only torch and the core, so registering them is cheap.
"""

from __future__ import annotations

import importlib

from pagedllm import hookimpl

_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    # vision-language checkpoints, served as their text model
    "Gemma3ForConditionalGeneration": ("multimodal_text", "Gemma3ForConditionalGeneration"),
    "Llama4ForConditionalGeneration": ("multimodal_text", "Llama4ForConditionalGeneration"),
}


def _load(arch: str):
    module, cls = _ARCHITECTURES[arch]
    return getattr(importlib.import_module(f"pagedllm.plugins.models.{module}"), cls)


@hookimpl
def pagedllm_model_architectures():
    return {arch: _load(arch) for arch in _ARCHITECTURES}
