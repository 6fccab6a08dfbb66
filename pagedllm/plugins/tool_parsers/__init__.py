"""Tool-call parsers (hermes, llama3_json, mistral, qwen3_xml, pythonic)."""

from __future__ import annotations

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_tool_parsers():
    return {}
