"""Tool-call parsers (hermes, llama3_json, mistral, qwen3_xml, pythonic), by their vLLM
`--tool-call-parser` names. Each module is one format; `base` holds what they share."""

from __future__ import annotations

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_tool_parsers():
    from pagedllm.plugins.tool_parsers.hermes import HermesToolParser
    from pagedllm.plugins.tool_parsers.llama3_json import Llama3JsonToolParser
    from pagedllm.plugins.tool_parsers.mistral import MistralToolParser
    from pagedllm.plugins.tool_parsers.pythonic import PythonicToolParser
    from pagedllm.plugins.tool_parsers.qwen3_xml import Qwen3XMLToolParser

    return {
        "hermes": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
        "mistral": MistralToolParser,
        "pythonic": PythonicToolParser,
        "qwen3_xml": Qwen3XMLToolParser,
        "qwen3_coder": Qwen3XMLToolParser,
    }
