"""Tool-call parsers: text in, tool calls out.

A parser reads a model's completion text (the chat template told the model about the
tools) and finds the calls in it, in the model family's own syntax (Hermes'
`<tool_call>{...}</tool_call>`, Llama 3's bare JSON, Mistral's `[TOOL_CALLS]`, Qwen3's
XML, pythonic `[f(x=1)]`). The contract is text only, so a parser package need not
import the server: the server turns `ParsedTools` into OpenAI's message and stream
shapes. Parsing is of the cumulative text, as the reasoning parsers do: a stream asks
again with more text and sends what grew.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text. While a stream is
    unfinished the arguments may be a prefix of the final text (they only grow)."""

    name: str
    arguments: str


@dataclass
class ParsedTools:
    """A completion split into the text meant for the user and the calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """Finds tool calls in completion text. One instance per choice being parsed."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def parse(self, text: str, finished: bool) -> ParsedTools:
        """The content and calls in `text` so far. Unless `finished`, text that could
        still become a call is held back from `content`; `content` and every call's
        `arguments` only grow from one call to the next (a stream sends the growth)."""
