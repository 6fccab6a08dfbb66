"""`--reasoning-parser NAME`: the parser classes by name, from the plugins.

The parsers themselves are plugins (`pagedllm/plugins/reasoning_parsers/`, contract in
`pagedllm/core/contracts/reasoning.py`); this module only looks them up, so that an
unknown name fails at start-up listing the names installed here. `ReasoningDelta` and
`DeepSeekR1ReasoningParser` are re-exported for the server's modules and older imports.
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.contracts.reasoning import ReasoningDelta, ReasoningParser
from pagedllm.core.plugins import get_registry

__all__ = ["ReasoningDelta", "ReasoningParser", "available_reasoning_parsers", "get_reasoning_parser",
           "reasoning_parser_class"]


def available_reasoning_parsers() -> dict[str, type[ReasoningParser]]:
    """Every reasoning parser the installed plugins provide, by name."""
    return dict(get_registry().reasoning_parsers)


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The class `--reasoning-parser NAME` means; ValueError listing those there are."""
    parsers = available_reasoning_parsers()
    if name not in parsers:
        raise ValueError(f"unknown --reasoning-parser {name!r}; available: {', '.join(sorted(parsers)) or '(none)'}"
                         " (a plugin adds more through the pagedllm_reasoning_parsers hook)")
    return parsers[name]


def get_reasoning_parser(name: str, tokenizer: Any = None) -> ReasoningParser:
    """A fresh parser named `name` (one per choice parsed)."""
    return reasoning_parser_class(name)(tokenizer)


def __getattr__(name: str) -> Any:
    # The built-in class, imported lazily so this module's import loads no plugin.
    if name == "DeepSeekR1ReasoningParser":
        return reasoning_parser_class("deepseek_r1")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
