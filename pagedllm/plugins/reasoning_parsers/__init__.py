"""Reasoning parsers (deepseek_r1, qwen3, granite), by their vLLM `--reasoning-parser`
names. Each module is one model family's syntax; `base` holds the split they share."""

from __future__ import annotations

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_reasoning_parsers():
    from pagedllm.plugins.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
    from pagedllm.plugins.reasoning_parsers.granite import GraniteReasoningParser
    from pagedllm.plugins.reasoning_parsers.qwen3 import Qwen3ReasoningParser

    return {
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "granite": GraniteReasoningParser,
        "qwen3": Qwen3ReasoningParser,
    }
