"""pagedllm: a small LLM inference and serving engine with vLLM's API.

Importing the package is cheap: `LLM` and the request types load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "hookimpl",
           "__version__"]

if TYPE_CHECKING:
    from pagedllm.core.request import CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams
    from pagedllm.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"):
        from pagedllm.core import request

        return getattr(request, name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
